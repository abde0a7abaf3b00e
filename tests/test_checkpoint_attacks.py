"""Checkpoints under attack (issue 29): a full disk mid-save on a real tmpfs (1 and 2 processes), crafted
allow-listed DeepSpeed objects, malformed manifests, checksums at every read (export, eval, universal/), names
outside their folder, unbounded or non-regular record files, and the disk accounting of hard-linked files.

One real 3-step ZeRO-2 bf16 run of the tiny model (a checkpoint after every step) is trained once per module; each
test works on its own copy.
"""
from __future__ import annotations

import collections
import copyreg
import json
import os
import shutil
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest
import torch

from crate_clip.checkpoint_io.deepspeed_checkpoints import (DamagedCheckpointError, consolidate_deepspeed_checkpoint,
                                                            read_info, read_info_checked)
from crate_clip.checkpoint_io.file_checksums import CHECKSUMS_KEY, file_checksum
from crate_clip.checkpoint_io.safe_unpickling import UntrustedCheckpointError, load_torch_file
import warm_python
from train_fixtures import REPO_ROOT, ranks_cmd, run_env, run_job, tiny_config, write_config

TAGS = [f"stage0-step{s:08d}" for s in range(5)]
OPTIM = "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"


def _stage(steps: int) -> dict:
    return {"name": "low", "image_size": 16, "context_length": 16, "samples": 8 * steps, "global_batch": 8,
            "lr": 2e-3, "warmup_steps": 1}


def _config(run_dir: Path, data: Path, steps: int, path: Path, keep_last: int = 3) -> Path:
    cfg = tiny_config(run_dir, data, precision="bf16", stages=[_stage(steps)], every_steps=1, evals=False,
                      logging={"tensorboard": False, "plot": False})
    cfg["data"]["num_workers"] = 0
    cfg["checkpoint"]["keep_last"] = keep_last
    return write_config(cfg, path)


def _train(nproc: int, *args: str, timeout: int = 400) -> subprocess.CompletedProcess:
    """One process, or N forked ranks (ranks_cmd)."""
    if nproc == 1:
        return run_job([sys.executable, "-m", "crate_clip.train.cli", *args], timeout=timeout)
    return run_job(ranks_cmd(nproc, *args, module="crate_clip.train.cli"), timeout=timeout)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_fmnist) -> Path:
    """A finished 3-step run (checkpoints after steps 1, 2 and 3) and its config."""
    root = tmp_path_factory.mktemp("attacks")
    config = _config(root / "run", tiny_fmnist, 3, root / "run.yaml")
    proc = _train(1, "--config", str(config))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return root / "run"


def _copy(trained: Path, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(trained, run, symlinks=True)
    return run


def _edit_info(tag: Path, edit) -> None:
    info = json.loads((tag / "crate_clip.json").read_text())
    edit(info)
    (tag / "crate_clip.json").write_text(json.dumps(info))


def _one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip() and "[WARNING]" not in line and "[INFO]" not in line]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    return lines[0]


# ---------------------------------------------------------------- 1. a full disk mid-save, on a real tmpfs
@pytest.fixture
def tmpfs(tmp_path):
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=150m", "tmpfs", str(mount)], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        pytest.skip(f"mount -t tmpfs is not permitted here ({proc.stderr.strip()}): the full-disk test needs a "
                    "small real file system")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def _used(mount: Path) -> int:
    return shutil.disk_usage(mount).used


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_full_disk_mid_save_removes_the_partial_save_and_the_resume_removes_leftovers(tmpfs, tiny_fmnist, nproc,
                                                                                       tmp_path):
    """150 MB hold two checkpoints of ~64 MB, not a third: the third save fails (torch's zip writer reports it as
    RuntimeError 'unexpected pos', ENOSPC only as its context), the run ends in one line with exit 6 naming the
    save, its `.saving` folder is gone (the space is free again). A resume, after the disk is grown just enough
    for one more checkpoint but not for the leftovers planted meanwhile (another save's `.saving`, a killed
    conversion's `.universal.converting`), removes them, says so, and finishes."""
    config = _config(tmpfs / "run", tiny_fmnist, 4, tmp_path / "run.yaml")
    proc = _train(nproc, "--config", str(config))   # 2: forked ranks, whose launcher passes the rank's code on
    ckpts = tmpfs / "run" / "checkpoints"
    assert proc.returncode == 6, proc.stdout[-2000:] + proc.stderr[-4000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("crate-clip train:")]
    # one line of ours (rank 0's), no traceback: under torchrun, whose own ChildFailedError traceback follows a
    # failing worker, test_cli_errors checks that none of its frames are crate-clip's
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-4000:]
    assert f"no space left on {ckpts} while saving {TAGS[3]}" in errors[0], errors[0]
    assert f"the last complete checkpoint is {TAGS[2]}" in errors[0]
    assert not list(ckpts.glob(".*.saving")), sorted(p.name for p in ckpts.iterdir())
    assert (ckpts / "latest").read_text() == TAGS[2] and read_info(ckpts / TAGS[2]) is not None
    size = sum(p.stat().st_size for p in (ckpts / TAGS[2]).rglob("*") if p.is_file())
    assert _used(tmpfs) < 2.3 * size, (_used(tmpfs), size)   # the partial third one does not hold space

    leftover = ckpts / f".{TAGS[4]}.saving"
    leftover.mkdir()
    (leftover / "blob").write_bytes(os.urandom(30 << 20))
    (ckpts / TAGS[2] / ".universal.converting").mkdir()
    (ckpts / TAGS[2] / ".universal.converting" / "fp32.pt").write_bytes(os.urandom(10 << 20))
    grown = _used(tmpfs) - (40 << 20) + int(1.25 * size)   # one more checkpoint fits only without the leftovers
    subprocess.run(["mount", "-o", f"remount,size={grown}", str(tmpfs)], check=True)
    proc = _train(nproc, "--config", str(config), "--resume", "latest", "--set", "checkpoint.keep_last=1")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    out = proc.stdout + proc.stderr
    assert f"removed what interrupted writes left in {ckpts}" in out, out[-3000:]
    assert f".{TAGS[4]}.saving (30.0 MiB)" in out and f"{TAGS[2]}/.universal.converting (10.0 MiB)" in out
    assert (ckpts / "latest").read_text() == TAGS[4] and not leftover.exists()


def test_a_write_failure_record_keeps_a_runtime_error_whose_context_is_enospc(tmp_path):
    """The record of a failed write keeps whatever the writer raised (RuntimeError from torch's zip writer with
    the ENOSPC only as its context): is_no_space finds it along the chain, and the ranks share it as plain data."""
    import errno

    from crate_clip.checkpoint_io.write_failures import WriteFailures

    def zip_writer_on_a_full_disk():
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:778] . unexpected pos 2048 vs 1946")

    writes = WriteFailures()
    writes.run(tmp_path / "x.pt", zip_writer_on_a_full_disk)
    failure = writes.failure()
    assert failure.no_space and "unexpected pos" in failure.error and failure.path == str(tmp_path / "x.pt")
    import pickle
    assert pickle.loads(pickle.dumps(failure)) == failure


# ---------------------------------------------------------------- 2. crafted allow-listed objects
class _Crafted:
    """Pickles as `cls(*args)` (REDUCE, how an enum member is pickled) or `cls.__new__(cls, *args)` (NEWOBJ, how
    DeepSpeed's objects are) followed by a BUILD of `state`: what a crafted file can hold."""

    def __init__(self, cls, args, state, newobj: bool = True):
        self.cls, self.args, self.state, self.newobj = cls, args, state, newobj

    def __reduce__(self):
        return self.cls, self.args, self.state

    def __new__(cls, target, args, state, newobj: bool = True):
        if not newobj:
            return super().__new__(cls)
        obj = object.__new__(target)   # pickle's NEWOBJ wants an instance of the class it names
        obj.__dict__["__reduce_ex__"] = lambda protocol: (copyreg.__newobj__, (target, *args), state)
        return obj


def _crafted_objects():
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return {
        "enum member rewritten": _Crafted(ZeroStageEnum, (2,), {"_value_": 3}, newobj=False),
        "enum value out of range": _Crafted(ZeroStageEnum, (7,), None, newobj=False),
        "scaler built by a call": _Crafted(DynamicLossScaler, (1.0, 2.0, 1, 2, True), None, newobj=False),
        "scaler built with arguments": _Crafted(LossScaler, (5,), {"cur_scale": 1.0, "dynamic": False}),
        "method shadowed": _Crafted(LossScaler, (), {"cur_scale": 1.0, "dynamic": False,
                                                     "backward": collections.OrderedDict}),
        "half-initialised dynamic scaler": _Crafted(DynamicLossScaler, (), {"cur_scale": 1.0, "dynamic": True}),
        "static scaler claiming dynamic": _Crafted(LossScaler, (), {"cur_scale": 1.0, "dynamic": True}),
        "string field": _Crafted(fragment_address, (), {"numel": "3", "start": 0}),
    }


def _process_wide_state():
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    return ([(m.name, m.value, m._value_, int(m)) for m in ZeroStageEnum], ZeroStageEnum(2).name,
            sorted(vars(LossScaler)), sorted(vars(DynamicLossScaler)))


@pytest.mark.parametrize("what", list(_crafted_objects()))
def test_a_crafted_allow_listed_object_is_refused_and_changes_nothing(what, tmp_path):
    before = _process_wide_state()
    torch.save({"optimizer_state_dict": {"zero_stage": _crafted_objects()[what]}}, tmp_path / "optim.pt")
    with pytest.raises(UntrustedCheckpointError, match="optim.pt: refused"):
        load_torch_file(tmp_path / "optim.pt")
    assert _process_wide_state() == before


def test_genuine_objects_rebuild_as_deepspeed_classes_with_their_fields(tmp_path):
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    dynamic = DynamicLossScaler(init_scale=2 ** 16, scale_window=1000, min_scale=1, delayed_shift=2,
                                consecutive_hysteresis=False)
    torch.save({"s": LossScaler(4), "d": dynamic, "z": ZeroStageEnum.weights, "f": fragment_address(3, 5)},
               tmp_path / "ok.pt")
    back = load_torch_file(tmp_path / "ok.pt")
    assert type(back["s"]) is LossScaler and vars(back["s"]) == {"cur_scale": 4, "dynamic": False}
    assert type(back["d"]) is DynamicLossScaler and vars(back["d"]) == vars(dynamic)
    assert back["z"] is ZeroStageEnum.weights and type(back["f"]) is fragment_address and back["f"].start == 5
    torch.save(back, tmp_path / "again.pt")   # re-saved under DeepSpeed's own names
    assert load_torch_file(tmp_path / "again.pt")["d"].scale_window == 1000


@pytest.mark.slow
def test_a_checkpoint_with_a_crafted_zero_stage_is_refused_by_deepspeeds_readers(trained, tmp_path):
    """The issue's case: the optimizer states of a foreign checkpoint hold ZeroStageEnum rebuilt with
    {_value_: 3}, its checksums rewritten to match: the export reader (DeepSpeed's zero_to_fp32 under the
    allow-list) refuses it, and the process-wide enum keeps its values."""
    run = _copy(trained, tmp_path)
    tag = run / "checkpoints" / TAGS[3]
    from deepspeed.runtime.zero.config import ZeroStageEnum

    states = torch.load(tag / OPTIM, map_location="cpu", weights_only=False)   # the test's own file
    assert states["optimizer_state_dict"]["zero_stage"] is ZeroStageEnum.gradients
    states["optimizer_state_dict"]["zero_stage"] = _Crafted(ZeroStageEnum, (2,), {"_value_": 3}, newobj=False)
    torch.save(states, tag / OPTIM)
    _edit_info(tag, lambda info: info[CHECKSUMS_KEY].update({OPTIM: file_checksum(tag / OPTIM)}))
    before = _process_wide_state()
    with pytest.raises(UntrustedCheckpointError, match=OPTIM):
        consolidate_deepspeed_checkpoint(tag)
    assert _process_wide_state() == before and ZeroStageEnum.gradients.value == 2


# ---------------------------------------------------------------- 3. malformed manifests
MALFORMED = {
    "global_step a string": lambda info: info.update(global_step=str(info["global_step"])),
    "checksums a list": lambda info: info.update({CHECKSUMS_KEY: list(info[CHECKSUMS_KEY].items())}),
    "bytes a string": lambda info: info[CHECKSUMS_KEY][OPTIM].update(bytes=str(info[CHECKSUMS_KEY][OPTIM]["bytes"])),
    "not an object": lambda info: (info.clear(), info.update(x=1)) and None,
}


@pytest.mark.slow
@pytest.mark.parametrize("what", [*MALFORMED, "crate_clip.json deleted"])
def test_a_malformed_manifest_marks_its_checkpoint_damaged_and_latest_falls_back(trained, tmp_path, capsys, what):
    from crate_clip.train.checkpointing.checkpoints import CheckpointManager
    from crate_clip.train.checkpointing.checkpoints import intact_checkpoint

    run = _copy(trained, tmp_path)
    tag = run / "checkpoints" / TAGS[3]
    if what == "crate_clip.json deleted":
        (tag / "crate_clip.json").unlink()
    elif what == "not an object":
        (tag / "crate_clip.json").write_text("[1, 2]")
    else:
        _edit_info(tag, MALFORMED[what])
    assert read_info(tag) is None
    ckpts = CheckpointManager(run / "checkpoints", 3, 0, 1)
    assert ckpts.complete_tags() == TAGS[1:3]
    chosen = intact_checkpoint(ckpts, ckpts.resolve("latest"), "latest")
    assert chosen.name == TAGS[2]
    out = capsys.readouterr().out
    assert f"{TAGS[3]} is damaged (crate_clip.json is " in out and f"resuming from {TAGS[2]}" in out, out
    assert len(out.strip().splitlines()) == 1
    if what != "crate_clip.json deleted":   # without one it reads as a DeepSpeed checkpoint from elsewhere
        with pytest.raises(DamagedCheckpointError, match=f"{TAGS[3]}: damaged checkpoint: its crate_clip.json is"):
            consolidate_deepspeed_checkpoint(tag)


@pytest.mark.slow
def test_resume_auto_past_a_manifest_with_a_string_step(trained, tmp_path, tiny_fmnist):
    """The issue's case end to end: `"global_step": "3"` in the newest crate_clip.json, `--resume auto` resumes
    from the one before, said in one line, and trains the last step again."""
    run = _copy(trained, tmp_path)
    _edit_info(run / "checkpoints" / TAGS[3], MALFORMED["global_step a string"])
    config = _config(run, tiny_fmnist, 3, tmp_path / "run.yaml")
    proc = _train(1, "--config", str(config), "--resume", "auto")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    warned = [line for line in (proc.stdout + proc.stderr).splitlines() if f"{TAGS[3]} is damaged" in line]
    assert len(warned) == 2 and "global_step is a string" in warned[0] and f"resuming from {TAGS[2]}" in warned[0]
    aside = run / "checkpoints" / f"{TAGS[3]}.damaged"   # its step is saved again: the damaged one is moved aside
    assert warned[1].endswith(f"moved to {aside}, not deleted; remove it once you no longer need it"), warned[1]
    assert json.loads((aside / "crate_clip.json").read_text())["global_step"] == "3"
    assert read_info(run / "checkpoints" / TAGS[3])["global_step"] == 3   # saved again, well-formed


# ---------------------------------------------------------------- 4. checksums at every read
def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 8] = bytes(b ^ 0xFF for b in data[middle:middle + 8])
    path.write_bytes(bytes(data))


@pytest.mark.slow
def test_flipped_optimizer_bytes_make_export_and_eval_refuse(trained, tmp_path, capsys):
    from crate_clip.cli import main

    run = _copy(trained, tmp_path)
    optim = run / "checkpoints" / TAGS[3] / OPTIM
    size = optim.stat().st_size
    _flip(optim)
    assert optim.stat().st_size == size
    code = main(["export", str(run), "--out", str(tmp_path / "export")])
    line = _one_line(capsys.readouterr().err)
    assert code == 2 and not (tmp_path / "export").exists()
    assert f"{TAGS[3]}: damaged checkpoint: {OPTIM}: sha256 differs" in line, line
    code = main(["eval", "zeroshot", "--model", str(run / "checkpoints"), "--data", "unused", "--dataset",
                 "fashion_mnist", "--device", "cpu", "--no-progress"])
    line = _one_line(capsys.readouterr().err)
    assert code == 2 and f"{OPTIM}: sha256 differs" in line, line


@pytest.mark.slow
def test_universal_folder_has_a_manifest_verified_before_use_and_counts_links_once(trained, tmp_path):
    """convert_to_universal records every file of universal/ in converted.json; a changed fp32.pt is found
    (and the resume converts again instead of loading it); the free-space accounting counts the model-states
    file hard-linked under both loaders' names once; a killed conversion's folder is a leftover."""
    from crate_clip.train.run.disk_space import checkpoint_bytes, leftovers, remove_leftovers, save_bytes
    from crate_clip.train.checkpointing.elastic_resume import CONVERTED_FILE, convert_to_universal, universal_damage

    run = _copy(trained, tmp_path)
    tag = run / "checkpoints" / TAGS[3]
    plain = sum(p.stat().st_size for p in tag.rglob("*") if p.is_file())
    universal = convert_to_universal(tag)
    record = json.loads((universal / CONVERTED_FILE).read_text())[CHECKSUMS_KEY]
    files = {p.relative_to(universal).as_posix() for p in universal.rglob("*") if p.is_file()} - {CONVERTED_FILE}
    assert set(record) == files and universal_damage(universal) is None
    linked = [universal / n for n in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")]
    assert os.stat(linked[0]).st_ino == os.stat(linked[1]).st_ino   # hard-linked
    distinct = {(os.lstat(p).st_ino): os.lstat(p).st_size for p in tag.rglob("*") if p.is_file()}
    assert checkpoint_bytes(tag) == sum(distinct.values()) < sum(p.stat().st_size for p in tag.rglob("*")
                                                                 if p.is_file())
    assert save_bytes(tag) == plain

    fp32 = next(universal.glob("zero/*/fp32.pt"))
    _flip(fp32)
    assert "fp32.pt: sha256 differs" in universal_damage(universal)

    converting = tag / ".universal.converting"
    converting.mkdir()
    (converting / "fp32.pt").write_bytes(b"0" * 1000)
    assert leftovers(run / "checkpoints") == [converting]
    assert checkpoint_bytes(tag) == sum(distinct.values())   # a leftover is not part of the checkpoint
    assert remove_leftovers(run / "checkpoints") == [f"{TAGS[3]}/.universal.converting (0.1 MiB)"]
    assert not converting.exists()


# ---------------------------------------------------------------- 5. names outside the folder, unbounded reads
@pytest.mark.slow
def test_checksum_names_outside_the_folder_are_refused_without_looking(trained, tmp_path):
    from crate_clip.checkpoint_io.file_checksums import ChecksumMismatchError, verify_recorded_checksums
    from crate_clip.train.checkpointing.checkpoints import CheckpointManager
    from crate_clip.train.checkpointing.checkpoints import checkpoint_damage

    run = _copy(trained, tmp_path)
    tag = run / "checkpoints" / TAGS[3]
    passwd = {"bytes": 1, "sha256": "0" * 64}
    for name in ("../../../../../../etc/passwd", "/etc/passwd"):
        _edit_info(tag, lambda info: info[CHECKSUMS_KEY].update({name: passwd}))
        why = read_info_checked(tag)[1]
        assert "leaves its folder" in why or "not relative" in why, why
        damage = checkpoint_damage(CheckpointManager(run / "checkpoints", 3, 0, 1), tag)
        assert len(damage) == 1 and f"{os.stat('/etc/passwd').st_size:,}" not in damage[0], damage
        with pytest.raises(ChecksumMismatchError, match="file_checksums: file name"):
            verify_recorded_checksums(tag, {CHECKSUMS_KEY: {name: passwd}}, "open_clip_config.json")
        _edit_info(tag, lambda info: info[CHECKSUMS_KEY].pop(name))


@pytest.mark.slow
def test_a_manifest_linked_to_a_huge_sparse_file_is_refused_without_reading_it(trained, tmp_path):
    run = _copy(trained, tmp_path)
    tag = run / "checkpoints" / TAGS[3]
    sparse = tmp_path / "sparse.json"
    with open(sparse, "wb") as f:
        f.truncate(200 << 20)
    (tag / "crate_clip.json").unlink()
    (tag / "crate_clip.json").symlink_to(sparse)
    tracemalloc.start()
    info, why = read_info_checked(tag)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert info is None and "is 209,715,200 bytes, more than" in why and peak < 4 << 20, (why, peak)


@pytest.mark.slow
def test_a_fifo_latest_gives_one_line_and_does_not_block(trained, tmp_path):
    """eval of a checkpoints folder whose `latest` is a FIFO: one line (exit 2), never a read that waits for a
    writer; a training resume takes the newest complete checkpoint instead (a garbled `latest`)."""
    run = _copy(trained, tmp_path)
    (run / "checkpoints" / "latest").unlink()
    os.mkfifo(run / "checkpoints" / "latest")
    code = ("import sys; from crate_clip.cli import main; sys.exit(main(['eval', 'zeroshot', '--model', sys.argv[1], "
            "'--data', 'unused', '--dataset', 'fashion_mnist', '--device', 'cpu', '--no-progress']))")
    proc = warm_python.run([sys.executable, "-c", code, str(run / "checkpoints")], env=run_env(), cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120)
    line = _one_line(proc.stderr)
    assert proc.returncode == 2 and "latest: a FIFO, not a regular file" in line, line
    from crate_clip.train.checkpointing.checkpoints import CheckpointManager

    assert CheckpointManager(run / "checkpoints", 3, 0, 1).latest_tag() == TAGS[3]


@pytest.mark.slow
def test_a_nan_normalisation_is_named_by_export_and_eval(trained, tmp_path):
    """A checkpoint whose crate_clip.json records a NaN mean: export and eval say so in one line (exit 2) and write
    nothing, instead of an export that holds the NaN and an evaluation that finds no image readable (issue 41)."""
    run = _copy(trained, tmp_path)
    tag = run / "checkpoints" / TAGS[3]
    _edit_info(tag, lambda info: info["normalisation"].update(mean=[float("nan"), 0.5, 0.5]))
    code = "import sys; from crate_clip.cli import main; sys.exit(main(sys.argv[1:]))"
    for argv in (["export", str(tag), "--out", str(tmp_path / "export")],
                 ["eval", "zeroshot", "--model", str(tag), "--data", "unused", "--dataset", "fashion_mnist", "--device",
                  "cpu", "--no-progress", "--output", str(tmp_path / "out.json")]):
        proc = warm_python.run([sys.executable, "-c", code, *argv], env=run_env(), cwd=REPO_ROOT, capture_output=True,
                               text=True, timeout=120)
        line = _one_line(proc.stderr)
        assert proc.returncode == 2 and f"{tag / 'crate_clip.json'}" in line, line
        assert "its image preprocessing cannot be used: normalisation.mean is [nan, 0.5, 0.5]" in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


@pytest.mark.slow
def test_a_fifo_for_the_model_states_is_named_and_never_read(trained, tmp_path):
    """The checksums are verified before any file is read: a FIFO where mp_rank_00_model_states.pt was is said to be
    one (not "missing"), and nothing waits for a writer (issue 41 item 6)."""
    run = _copy(trained, tmp_path)
    states = run / "checkpoints" / TAGS[3] / "mp_rank_00_model_states.pt"
    states.unlink()
    os.mkfifo(states)
    code = "import sys; from crate_clip.cli import main; sys.exit(main(sys.argv[1:]))"
    for argv in (["export", str(states.parent), "--out", str(tmp_path / "export")],
                 ["eval", "zeroshot", "--model", str(states.parent), "--data", "unused", "--dataset", "fashion_mnist",
                  "--device", "cpu", "--no-progress"]):
        proc = warm_python.run([sys.executable, "-c", code, *argv], env=run_env(), cwd=REPO_ROOT, capture_output=True,
                               text=True, timeout=120)
        line = _one_line(proc.stderr)
        assert proc.returncode == 2 and "mp_rank_00_model_states.pt: a FIFO where a file was" in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"] and states.is_fifo()
