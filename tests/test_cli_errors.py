"""Clear errors of the CLIs: one line naming the file and the fix, exit code 2, traceback with --debug."""
import json

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
    from crate_clip.cli_errors import DEBUG_ENV
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
