"""Clear errors of the CLIs: one line naming the file and the fix, exit code 2, traceback with --debug."""
import json
import re

import pytest
import torch
from safetensors.torch import save_file

from crate_clip.cli import main as crate_clip_main
from eval_fixtures import CRATE_TINY, shared_crate_tiny


def _truncated(path, data_writer):
    data_writer(path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return path


@pytest.fixture
def corrupt_files(tmp_path):
    state = {k: v.contiguous() for k, v in shared_crate_tiny().state_dict().items()}
    files = {"safetensors": _truncated(tmp_path / "w.safetensors", lambda p: save_file(state, p)),
             "pt": _truncated(tmp_path / "w.pt", lambda p: torch.save(state, p)),
             "pth": tmp_path / "w.pth"}
    files["pth"].write_bytes(b"\x80\x04garbage, not a checkpoint")
    tag = tmp_path / "run" / "checkpoints" / "stage0_step1"
    tag.mkdir(parents=True)
    (tag / "crate_clip.json").write_text(json.dumps({"model_name": CRATE_TINY}))
    _truncated(tag / "mp_rank_00_model_states.pt", lambda p: torch.save({"module": state}, p))
    files["checkpoint"] = tag
    return files


def _eval(*model_args, data="unused"):
    return crate_clip_main(["eval", "zeroshot", *model_args, "--data", data, "--dataset", "fashion_mnist",
                            "--device", "cpu", "--no-progress"])


@pytest.mark.parametrize("kind", ["safetensors", "pt", "pth", "checkpoint"])
def test_corrupt_weights_file_is_one_line_naming_the_file(corrupt_files, kind, capsys):
    path = corrupt_files[kind]
    args = ("--model", str(path)) if kind == "checkpoint" else ("--model", CRATE_TINY, "--pretrained", str(path))
    assert _eval(*args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert str(path.parent if kind == "checkpoint" else path) in err and "corrupt or truncated" in err and "Traceback" not in err
    assert "weights_only=False" not in err


def test_debug_shows_the_traceback(corrupt_files, monkeypatch):
    from crate_clip.core.errors import DEBUG_ENV
    from crate_clip.models.weights_files import CorruptWeightsError

    monkeypatch.setenv(DEBUG_ENV, "0")   # restored after the test (--debug sets it for child processes)

    with pytest.raises(CorruptWeightsError):
        crate_clip_main(["--debug", "eval", "zeroshot", "--model", CRATE_TINY, "--pretrained",
                         str(corrupt_files["safetensors"]), "--data", "unused", "--device", "cpu"])


def test_missing_checkpoint_folder_is_not_taken_for_a_model_name(tmp_path, capsys):
    missing = tmp_path / "run" / "checkpoints"
    assert _eval("--model", str(missing)) == 2
    err = capsys.readouterr().err.strip()
    assert str(missing) in err and "does not exist" in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("args, says", [
    (["--gpus", "0"], "argument --gpus: 0: at least 1 GPU"),
    (["--gpus", "1", "--mfu", "0"], "argument --mfu: 0: MFU is a fraction of the peak in (0, 1]"),
    (["--gpus", "1", "--mfu", "5"], "argument --mfu: 5: MFU is a fraction of the peak in (0, 1]"),
    (["--gpus", "1", "--gpu-memory", "80 parsecs"], "argument --gpu-memory: '80 parsecs' is not a size"),
    (["--gpus", "1", "--gpu-memory", "0GiB"], "the memory per GPU must be more than 0"),
])
def test_plan_refuses_impossible_numbers_in_one_line(args, says, capsys):
    with pytest.raises(SystemExit) as exit_info:
        crate_clip_main(["plan", "configs/demo/fashion_mnist.yaml", "--gpu", "h100", *args])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and says in err and "Traceback" not in err


def test_byte_sizes_take_binary_units_down_to_kib():
    from crate_clip.train.planning.planner import parse_bytes

    assert [parse_bytes(t) for t in ("1KiB", "64kb", "2k", "1.5MiB", "80GiB", "141G", "1TiB", "512")] == \
        [1024, 64 * 1024, 2048, 3 * 2 ** 19, 80 * 2 ** 30, 141 * 2 ** 30, 2 ** 40, 512]
    with pytest.raises(ValueError, match="not a size"):
        parse_bytes("lots")


def test_convert_names_the_known_models_for_an_unknown_one(tmp_path, capsys):
    from crate_clip.convert_cli import build_parser

    weights = tmp_path / "official.pth"
    torch.save({"visual.class_embedding": torch.zeros(8)}, weights)
    for extra in ([], ["--bert-vocab", "/work/shared/bert_base_uncased"]):
        code = crate_clip_main(["convert", "official", str(weights), "--model", "UNKNOWN", "--out",
                                str(tmp_path / "out"), *extra])
        err = capsys.readouterr().err.strip()
        assert code == 2 and len(err.splitlines()) == 1, err
        assert "--model UNKNOWN: no such open_clip model config" in err and "CRATE-alpha-CLIPA-L-14" in err
        assert "BPE" not in err
    description = build_parser().description
    assert description.endswith("after `import crate_clip`.") and "\n" not in description


def _stage0_checkpoint(root, tag, step):
    state = {k: v.contiguous() for k, v in shared_crate_tiny().state_dict().items()}
    (root / tag).mkdir(parents=True)
    torch.save({"module": state}, root / tag / "mp_rank_00_model_states.pt")
    (root / tag / "crate_clip.json").write_text(json.dumps({"model_name": CRATE_TINY, "global_step": step}))


def test_a_latest_file_that_is_not_text_counts_as_missing(tmp_path):
    from crate_clip.checkpoint_io.checkpoint_choice import EVAL, choose_checkpoint
    from crate_clip.train.checkpointing.checkpoints import CheckpointManager
    from crate_clip.eval.model_loading import load_eval_model

    root = tmp_path / "run" / "checkpoints"
    _stage0_checkpoint(root, "stage0_step1", 1)
    _stage0_checkpoint(root, "stage0_step2", 2)
    (root / "latest").write_bytes(b"\xff\xfe\x00garbled")
    assert choose_checkpoint(root, EVAL).tag_dir == root / "stage0_step2"
    assert CheckpointManager(root, keep_last=3, rank=0, world_size=1).latest_tag() == "stage0_step2"
    model, *_ = load_eval_model(str(root))
    assert torch.equal(model.state_dict()["visual.trunk.pos_embed"],
                       shared_crate_tiny().state_dict()["visual.trunk.pos_embed"])


@pytest.mark.multiproc
def test_under_torchrun_the_process_code_is_the_last_line(tmp_path, request):
    """torchrun exits 1 for any failing worker: the refused run says its own code (2) last."""
    from train_fixtures import run_job, stand_in_run_env, torchrun_cmd

    config = tmp_path / "bad.yaml"
    config.write_text("run: {output_dir: %s}\nstagez: []\n" % (tmp_path / "run"))
    proc = run_job(torchrun_cmd(1, "train", "--config", str(config), module="crate_clip.cli"),
                   env=stand_in_run_env(request))   # torchrun's worker: a stand-in for a warm command
    assert proc.returncode == 1, proc.stderr[-3000:]
    ours = [line for line in proc.stderr.splitlines() if line.startswith("crate-clip")]
    assert "stagez: unknown key" in proc.stderr and not (tmp_path / "run").exists()
    assert ours[-1].startswith("crate-clip: exit code 2 (configuration or input error"), ours
    # torchrun follows a failing worker with its own ChildFailedError traceback: none of its frames are ours
    # (the forked ranks of test_checkpoint_attacks' full-disk run print no traceback at all)
    assert "ChildFailedError" in proc.stderr and not re.search(r'File "[^"]*crate_clip/', proc.stderr), \
        proc.stderr[-3000:]
