"""Bad input to the CLIs ends in one line with exit code 2 (docs/exit_codes.md), before any work: a --pretrained that
is no weights file, a --model folder that is no checkpoint or export, an export config with unknown keys or absurd
sizes (refused before anything is allocated), a read-only output folder, numbers out of range, a missing .pth for
`convert` (said before the hub is asked). Each case ran into a raw traceback, a late failure or a minute of hub
retries before (issue 29, item 6)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from crate_clip.cli import main as crate_clip_main
from eval_fixtures import CRATE_TINY, shared_crate_tiny, write_tiny_export
from train_fixtures import REPO_ROOT, run_env, tiny_config, write_config


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    lines = [line for line in err.splitlines() if "real_accelerator" not in line]   # DeepSpeed's CPU notice
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def _eval(*model_args):
    return crate_clip_main(["eval", "zeroshot", *model_args, "--data", "unused", "--dataset", "fashion_mnist",
                            "--device", "cpu", "--no-progress"])


# ---------------------------------------------------------------- --pretrained that is no weights file
@pytest.mark.parametrize("content", [b"a text file\n", b"hello world\n", os.urandom(4096)],
                         ids=["text-IndexError", "text-KeyError", "random-bytes"])
@pytest.mark.parametrize("command", ["eval", "segment"])
def test_a_pretrained_file_that_holds_no_weights_is_one_line(tmp_path, capsys, content, command):
    weights = tmp_path / "weights.pt"
    weights.write_bytes(content)
    if command == "eval":
        code = _eval("--model", CRATE_TINY, "--pretrained", str(weights))
    else:
        code = crate_clip_main(["segment", "--model", CRATE_TINY, "--pretrained", str(weights), "--images", "x.png",
                                "--out", str(tmp_path / "out")])
    line = _one_line(capsys)
    assert code == 2
    # our own sentence, not another library's error marked "error: ... (--debug shows the traceback)"
    assert line.startswith(f"crate-clip {command}: {weights}: corrupt or truncated weights file"), line
    assert "--debug" not in line


# ---------------------------------------------------------------- --model folders that are no checkpoint
def _checkpoints_without_latest(tmp_path):
    checkpoints = tmp_path / "run" / "checkpoints"
    for step in (2, 4):
        tag = checkpoints / f"stage0_step{step}"
        tag.mkdir(parents=True)
        (tag / "crate_clip.json").write_text(json.dumps({"model_name": CRATE_TINY, "global_step": step}))
    return checkpoints, "a checkpoints folder without its `latest` file", f"--model {checkpoints / 'stage0_step4'}"


def _plain_folder(tmp_path):
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "notes.txt").write_text("not a model")
    return tmp_path / "plain", "neither a DeepSpeed checkpoint", "an export (open_clip_config.json)"


def _run_folder(tmp_path):
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    return tmp_path / "run", "a run folder", f"--model {tmp_path / 'run' / 'checkpoints'}"


@pytest.mark.parametrize("make", [_checkpoints_without_latest, _plain_folder, _run_folder])
def test_a_model_folder_that_is_no_checkpoint_says_what_it_is(tmp_path, capsys, make):
    folder, what, fix = make(tmp_path)
    assert _eval("--model", str(folder)) == 2
    line = _one_line(capsys)
    assert line.startswith(f"crate-clip eval: --model {folder}: ") and what in line and fix in line, line
    assert "not found in built-ins" not in line


def test_an_unknown_model_name_is_one_line_not_open_clips_list(capsys):
    assert _eval("--model", "CRATE-alpha-CLIPA-nonexistent") == 2
    line = _one_line(capsys)
    assert "no such open_clip model config" in line and "CRATE-alpha-CLIPA-tiny" in line
    assert "coca_base" not in line   # not open_clip's list of every config


# ---------------------------------------------------------------- an export config from a file
@pytest.fixture(scope="module")
def tiny_export(tmp_path_factory):
    return write_tiny_export(tmp_path_factory.mktemp("export") / "export")


def _vision(cfg, key, value):
    cfg["model_cfg"]["vision_cfg"][key] = value


def _text(cfg, key, value):
    cfg["model_cfg"]["text_cfg"][key] = value


@pytest.mark.parametrize("change, says", [
    (lambda c: _vision(c, "bogus", 1), "unknown key vision_cfg.bogus"),
    (lambda c: c["model_cfg"].update(surprise=True), "unknown key 'surprise'"),
    # depth 33 and width 1536: over the largest registered CRATE-alpha tower (H: 32 blocks, width 1280)
    (lambda c: _vision(c, "timm_model_name", "crate_alpha_clipa.w32_d33_h2_p4_28"),
     "larger than any registered CRATE-alpha tower (depth 33 > 32)"),
    (lambda c: _vision(c, "timm_model_name", "crate_alpha_clipa.w1536_d1_h12_p4_28"), "width 1,536 > 1,280"),
    (lambda c: _text(c, "width", 10_000_000), "text_cfg.width is 10,000,000, more than the 1,280"),
    (lambda c: _text(c, "layers", "2"), "text_cfg.layers is '2', not a positive integer"),
    (lambda c: c["model_cfg"].update(embed_dim=-5), "embed_dim is -5, not a positive integer"),
])
def test_an_export_config_is_checked_before_anything_is_built(tiny_export, tmp_path, capsys, change, says):
    export = tmp_path / "export"
    shutil.copytree(tiny_export, export)
    config = json.loads((export / "open_clip_config.json").read_text())
    change(config)
    (export / "open_clip_config.json").write_text(json.dumps(config))
    assert _eval("--model", f"local-dir:{export}") == 2
    line = _one_line(capsys)
    assert line.startswith(f"crate-clip eval: {export / 'open_clip_config.json'}: not a model config") and says in line


def test_the_untouched_export_still_loads(tiny_export):
    from crate_clip.eval.model_loading import load_eval_model

    model = load_eval_model(f"local-dir:{tiny_export}")[0]
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in shared_crate_tiny().parameters())


def test_every_registered_config_passes_the_check():
    """The check refuses only what no registered config (open_clip's, CoCa and ResNet ones included) has."""
    import open_clip.factory

    from crate_clip.models.model_cfg_check import check_model_cfg

    for name, cfg in open_clip.factory._MODEL_CONFIGS.items():
        check_model_cfg(cfg, name)


def test_a_parametric_tower_name_beyond_the_registered_families_allocates_nothing():
    """timm builds a tower from its name alone: the bounds hold for every caller, not only for exports."""
    import timm

    with pytest.raises(ValueError, match=r"larger than any registered CRATE-alpha tower \(depth 33 > 32\)"):
        timm.create_model("crate_alpha_clipa.w32_d33_h2_p4_28")
    assert timm.create_model("crate_alpha_clipa.w32_d2_h2_p4_28").patch_embed is not None   # within bounds: built


# ---------------------------------------------------------------- numbers out of range
@pytest.mark.parametrize("argv, says", [
    (["demo", "--nproc", "0"], "argument --nproc: 0: must be at least 1"),
    (["demo", "--max-train-images", "-1"], "argument --max-train-images: -1: must be at least 1"),
    (["demo", "--probe-train-images", "-3"], "argument --probe-train-images: -3: must be at least 0"),
    (["segment", "--model", CRATE_TINY, "--images", "x.png", "--out", "o", "--batch-size", "0"],
     "argument --batch-size: 0: must be at least 1"),
    (["segment", "--model", CRATE_TINY, "--images", "x.png", "--out", "o", "--tau", "-1"],
     "argument --tau: -1: must be at least 0 (a cosine-similarity threshold)"),
    (["segment", "--model", CRATE_TINY, "--images", "x.png", "--out", "o", "--masks", "0"],
     "argument --masks: 0: must be at least 1"),
    (["eval", "zeroshot", "--model", CRATE_TINY, "--data", "d", "--num-workers", "-1"],
     "argument --num-workers: -1: must be at least 0"),
    (["eval", "zeroshot", "--model", CRATE_TINY, "--data", "d", "--batch-size", "0"],
     "argument --batch-size: 0: must be at least 1"),
    (["shards", "inspect", "s", "--num-workers", "-1"], "argument --num-workers: -1: must be at least 0"),
])
def test_numbers_out_of_range_are_refused_while_parsing(tmp_path, monkeypatch, capsys, argv, says):
    monkeypatch.chdir(tmp_path)   # nothing may be written, not even relative to the working directory
    if argv[0] == "demo":
        argv = [*argv, "--data-dir", str(tmp_path / "data"), "--run-dir", str(tmp_path / "run")]
    with pytest.raises(SystemExit) as exit_info:
        crate_clip_main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and says in err.strip().splitlines()[-1] and "Traceback" not in err, err
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------- convert: the local file first
def test_convert_of_a_missing_file_says_so_before_the_hub(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")   # were the hub asked first, this would fail on the tokenizer
    missing = tmp_path / "missing.pth"
    code = crate_clip_main(["convert", "official", str(missing), "--out", str(tmp_path / "out")])
    line = _one_line(capsys)
    assert code == 2 and line == (f"crate-clip convert: {missing}: does not exist; fix: pass the released "
                                  "crate_alpha_CLIPA_*.pth file")
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- a read-only file system
def _can_mount_privately() -> bool:
    unshare = shutil.which("unshare")
    if unshare is None:
        return False
    probe = subprocess.run([unshare, "-rm", "sh", "-c", "mount -t tmpfs -o ro tmpfs /mnt 2>/dev/null"],
                           capture_output=True)
    return probe.returncode == 0


READ_ONLY = """set -u
mount -t tmpfs -o ro,size=1m tmpfs "$RO"
exec {python} -c "$DRIVER"
"""
# Inside the namespace: one interpreter imports the CLIs once (~6 s of CPU each time), then each command runs in a
# fork of it as `python -m crate_clip.cli ...` would (tests/warm_python.py's run_as_main), its output in LOGS.
DRIVER = """
import json, os, sys
sys.path.insert(0, os.environ["TESTS"])
import warm_python
warm_python.preload(warm_python.PRELOAD)
logs = os.environ["LOGS"]
for name, argv in json.loads(os.environ["COMMANDS"]):
    pid = os.fork()
    if pid == 0:
        for fd, suffix in ((1, "out"), (2, "err")):
            os.dup2(os.open(os.path.join(logs, name + "." + suffix), os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
        warm_python.exit_as_the_interpreter(warm_python.run_as_main(["-m", "crate_clip.cli", *argv], os.getcwd()))
    with open(os.path.join(logs, "codes"), "a") as codes:
        codes.write(f"{name} {os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])}\\n")
"""


@pytest.mark.skipif(not _can_mount_privately(), reason="needs `unshare -rm` to mount a read-only tmpfs privately")
def test_a_read_only_file_system_is_one_line_for_train_export_and_shards(tmp_path, tiny_fmnist):
    """A real read-only mount (a tmpfs mounted ro in a private mount namespace of a user namespace: `unshare -rm`,
    so nothing outside the test sees it); a chmod-ed folder would not do, root writes into it anyway."""
    ro, logs = tmp_path / "ro", tmp_path / "logs"
    ro.mkdir()
    logs.mkdir()
    config = write_config(tiny_config(ro / "run", tiny_fmnist, evals=False), tmp_path / "run.yaml")
    commands = [("train", ["train", "--config", str(config)]),
                ("export", ["export", str(ro / "run"), "--out", str(ro / "export")]),
                ("shards", ["shards", "fashion-mnist", "--out", str(ro / "shards"), "--max-images", "10"])]
    env = dict(run_env(), RO=str(ro), LOGS=str(logs), TESTS=str(REPO_ROOT / "tests"), DRIVER=DRIVER,
               COMMANDS=json.dumps(commands))
    script = READ_ONLY.format(python=sys.executable)
    subprocess.run(["unshare", "-rm", "sh", "-c", script], env=env, cwd=REPO_ROOT, check=True, timeout=300)
    codes = dict(line.split() for line in (logs / "codes").read_text().splitlines())
    assert codes == {"train": "2", "export": "2", "shards": "2"}, codes
    for command, folder, option in (("train", ro / "run", "run.output_dir"), ("export", ro / "export", "--out"),
                                    ("shards", ro / "shards", "--out")):
        err = (logs / f"{command}.err").read_text()
        lines = [line for line in err.strip().splitlines() if "real_accelerator" not in line]
        assert len(lines) == 1 and "Traceback" not in err, err
        assert f"{option} {folder}: cannot write there" in lines[0] and "Read-only file system (EROFS)" in lines[0]
