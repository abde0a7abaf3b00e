"""What a run folder survives, end to end with the real trainer (one process, the tiny model, 6 steps of batch 8,
a checkpoint after every step):

  - two trainers started together into one folder: one trains, the other is refused by the run-folder lock, one
    row per step; `--resume` and `--overwrite` of a live run are refused naming the holder;
  - a full disk during a save: one line, the partial save removed, no 0-byte plot, exit code 6;
  - then damaged checkpoints (a truncated model-states file, a half-truncated optimizer file, a garbled rank-state
    file) and a torn last metrics line: the resume names the damaged checkpoints, continues from the newest intact
    one and keeps every complete row; an evaluation refusal after the stage ends the run in one line (exit 2, the
    exit-code line under a launcher) keeping the stage's checkpoint; once the data is fixed the resume runs just the
    evaluations, and the export is bit for bit the uninterrupted run's.
Faults are injected where the operating system would raise them (run_dir_workers.py: /dev/full for a full disk).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from crate_clip.checkpoint_io.run_layout import lock_path
import warm_python
from train_fixtures import REPO_ROOT, read_jsonl, run_env, tiny_config, write_config

pytestmark = [pytest.mark.slow]

WORKERS = Path(__file__).resolve().parent / "run_dir_workers.py"
TRAIN = ["-m", "crate_clip.train.cli"]
# 52 samples in batches of 8: 6 steps (48 samples), said at the start of training
STAGE = {"name": "low", "image_size": 16, "context_length": 16, "samples": 52, "global_batch": 8, "lr": 2e-3,
         "warmup_steps": 1}
TAGS = [f"stage0-step{s:08d}" for s in range(7)]


def _config(run_dir: Path, test_dir: Path, data: Path) -> dict:
    cfg = tiny_config(run_dir, data, precision="fp32", stages=[STAGE], every_steps=1,
                      logging={"tensorboard": False, "plot": False})
    cfg["data"]["num_workers"] = 0   # the loader in the trainer: no worker process to start
    cfg["checkpoint"]["keep_last"] = 4
    cfg["eval"]["evals"][0].update(data=str(test_dir), max_images=50)
    return cfg


def _env(**extra: str) -> dict:
    return {**run_env(), **extra}


def _start(*args: str, env: dict | None = None) -> subprocess.Popen:
    return warm_python.Popen([sys.executable, *args], env=env or run_env(), cwd=REPO_ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return warm_python.run([sys.executable, *args], env=env or run_env(), cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=600)


def _show(proc) -> str:
    return proc.stdout[-3000:] + proc.stderr[-6000:]


def _ours(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("crate-clip")]


@pytest.fixture(scope="module")
def raced(tmp_path_factory, tiny_fmnist):
    """Two `crate-clip train` of one config started together; the one that trained is the reference run."""
    root = tmp_path_factory.mktemp("raced")
    test_dir = root / "test"
    shutil.copytree(tiny_fmnist / "test", test_dir)   # its own copy: a test breaks and mends it
    config = write_config(_config(root / "run", test_dir, tiny_fmnist), root / "run.yaml")
    procs = [_start(*TRAIN, "--config", str(config)) for _ in range(2)]
    how = _hold_the_winner_while_the_other_arrives(lock_path(root / "run"), procs)
    outs = [p.communicate(timeout=600) for p in procs]
    done = [subprocess.CompletedProcess(p.args, p.returncode, out, err) for p, (out, err) in zip(procs, outs)]
    return {"root": root, "run_dir": root / "run", "config": config, "test_dir": test_dir, "data": tiny_fmnist,
            "procs": procs, "done": done, "how": how}


def _hold_the_winner_while_the_other_arrives(lock: Path, procs: list) -> str:
    """Stop the process that took the lock until the other one has exited. Both race for the lock, but on a loaded
    machine one can import, train its 6 steps and release the lock before the other gets there (it then finds a
    finished run: exit 2, not the race this test is about); a stopped holder is a live one, so the late one is
    refused whenever it arrives. Returns what happened, for the assertion messages."""
    from crate_clip.train.run.run_lock import _read_holder

    pids = {p.pid: p for p in procs}
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        holder = _read_holder(lock)
        if holder is not None and holder.pid in pids:
            break
        ended = [(p.pid, p.returncode) for p in procs if p.poll() is not None]
        if ended:   # one ended before a holder was seen: the assertions show its output
            return f"no holder seen before (pid, exit code) {ended} ended; lock holder {holder}"
        time.sleep(0.02)
    else:
        return f"no holder among {sorted(pids)} in 300 s; lock holder {holder}"
    winner = pids[holder.pid]
    os.kill(winner.pid, signal.SIGSTOP)
    try:
        for p in procs:
            if p is not winner:
                p.wait(timeout=300)
    finally:
        os.kill(winner.pid, signal.SIGCONT)
    return f"held {winner.pid} (stopped) until the other exited"


def test_two_trainers_started_together_one_trains_one_is_refused(raced):
    run_dir, (first, second) = raced["run_dir"], raced["done"]
    codes = sorted([first.returncode, second.returncode])
    assert codes == [0, 5], raced["how"] + "\n" + _show(first) + _show(second)
    winner, loser = (first, second) if first.returncode == 0 else (second, first)
    winner_pid = raced["procs"][raced["done"].index(winner)].pid
    assert _ours(loser.stderr) == [
        f"crate-clip train: run.output_dir {run_dir} is in use by another run: PID {winner_pid} on this host "
        f"{_ours(loser.stderr)[0].split(' on this host ', 1)[1]}"]
    assert f"lock {run_dir}.lock" in loser.stderr and "Traceback" not in loser.stderr
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [(r["stage_index"], r["step"]) for r in rows] == [(0, s) for s in range(1, 7)]   # one writer
    assert [(r["eval"], r["image_size"], r["resize"]) for r in read_jsonl(run_dir / "results.jsonl")] == [
        ("fmnist", 16, "grid"), ("fmnist", 28, "grid"), ("fmnist", 28, "patch")]
    assert rows[-1]["samples_seen"] == 48 and not Path(f"{run_dir}.lock").exists()   # released at the end
    assert ("[note] stages.0.samples: 52 is not a multiple of global_batch 8: the stage trains 6 steps = 48 samples"
            in winner.stdout)


def test_resume_and_overwrite_of_a_live_run_are_refused_naming_it(raced):
    from crate_clip.train.run.run_lock import RunLock

    run_dir, config = raced["run_dir"], str(raced["config"])
    before = sorted((str(p), p.stat().st_mtime_ns) for p in run_dir.rglob("*"))
    lock, _ = RunLock.acquire(run_dir)   # this test process is the live run
    try:
        proc = _run(str(WORKERS), "train_twice", "--config", config, "--resume", "latest", "--",
                    "--config", config, "--overwrite")
    finally:
        lock.release()
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [5, 5], _show(proc)
    lines = _ours(proc.stderr)
    assert len(lines) == 2 and all(line.startswith(f"crate-clip train: run.output_dir {run_dir} is in use by another "
                                                   f"run: PID {os.getpid()} on this host") for line in lines)
    assert sorted((str(p), p.stat().st_mtime_ns) for p in run_dir.rglob("*")) == before   # nothing touched
    assert not Path(f"{run_dir}.previous").exists()


def test_full_disk_then_damaged_checkpoints_torn_metrics_and_a_refused_evaluation(raced):
    root, test_dir = raced["root"], raced["test_dir"]
    run_dir = root / "again"
    config = write_config(_config(run_dir, test_dir, raced["data"]), root / "again.yaml")
    ckpts = run_dir / "checkpoints"

    # ---- the disk is full when checkpoint 5 is saved (and for the plot)
    full = _run(str(WORKERS), "no_space", TAGS[5], "--config", str(config), "--set", "logging.plot=true")
    assert full.returncode == 6, _show(full)
    assert _ours(full.stderr) == [f"crate-clip train: no space left on {ckpts} while saving {TAGS[5]}; the last "
                                  f"complete checkpoint is {TAGS[4]}; free some space there and resume (--resume "
                                  "latest)"], _show(full)
    assert "Traceback" not in full.stderr
    assert sorted(p.name for p in ckpts.iterdir() if p.is_dir()) == TAGS[1:5]   # the partial save is gone
    assert (ckpts / "latest").read_text() == TAGS[4]
    assert not (run_dir / "training_curve.png").exists() and not list(run_dir.glob(".training_curve*"))
    assert f"[warn] {run_dir / 'training_curve.png'} not written: [Errno 28] No space left on device" in full.stdout

    # ---- the three newest checkpoints damaged, the last metrics line torn, the evaluation set broken
    model_states = ckpts / TAGS[4] / "mp_rank_00_model_states.pt"
    os.truncate(model_states, 1000)
    optimizer = ckpts / TAGS[3] / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    os.truncate(optimizer, optimizer.stat().st_size // 2)
    rank_state = ckpts / TAGS[2] / "train_state_rank00000.pt"
    with open(rank_state, "r+b") as f:
        f.seek(rank_state.stat().st_size // 2)
        f.write(b"\xff" * 64)
    fragment = '{"stage_index": 0, "step": 6, "global_st'
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write(fragment)
    (test_dir / "8_bag").rename(test_dir / "purse")
    damaged = (f"[warn] {TAGS[4]} is damaged (mp_rank_00_model_states.pt: 1,000 bytes where crate_clip.json records "
               f"{_recorded(ckpts / TAGS[4], model_states.name):,}); {TAGS[3]} is damaged ({optimizer.name}: "
               f"{optimizer.stat().st_size:,} bytes where crate_clip.json records "
               f"{_recorded(ckpts / TAGS[3], optimizer.name):,}); {TAGS[2]} is damaged ({rank_state.name}: sha256 "
               f"differs from the one crate_clip.json records); resuming from {TAGS[1]}, the newest intact checkpoint "
               f"in {ckpts}")

    launched = _env(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_port()))
    refused = _run(*TRAIN, "--config", str(config), "--resume", "latest", env=launched)
    assert refused.returncode == 2, _show(refused)
    assert damaged in refused.stdout.splitlines(), _show(refused)
    assert f"resuming from {ckpts / TAGS[1]}" in refused.stdout
    lines = _ours(refused.stderr)
    assert len(lines) == 2 and "Traceback" not in refused.stderr, _show(refused)
    assert lines[0].startswith(f"crate-clip train: stage 0 (low) evaluation at 16 px: {test_dir}: folders 'purse' "
                               "match no class name")
    assert lines[0].endswith(f"The stage's final checkpoint {TAGS[6]} is kept; once this is fixed, --resume latest "
                             "runs the missing evaluations")
    assert lines[1].startswith("crate-clip: exit code 2 (configuration or input error")
    assert (ckpts / "latest").read_text() == TAGS[6] and not (run_dir / "results.jsonl").exists()

    # ---- the data mended: the resume runs just the evaluations and exports
    (test_dir / "purse").rename(test_dir / "8_bag")
    resumed = _run(*TRAIN, "--config", str(config), "--resume", "latest")
    assert resumed.returncode == 0, _show(resumed)
    assert f"resuming from {ckpts / TAGS[6]}" in resumed.stdout and "damaged" not in resumed.stdout
    reference = raced["run_dir"]
    assert [(r["eval"], r["image_size"], r["top1"]) for r in read_jsonl(run_dir / "results.jsonl")] == [
        (r["eval"], r["image_size"], r["top1"]) for r in read_jsonl(reference / "results.jsonl")]
    weights = "export/open_clip_model.safetensors"
    assert (run_dir / weights).read_bytes() == (reference / weights).read_bytes()   # bit for bit

    # every complete metrics row kept, one per step; the rows of the cut-short segment and the fragment set aside
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert [r["loss"] for r in rows] == [r["loss"] for r in read_jsonl(reference / "metrics.jsonl")]
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.superseded.jsonl")] == [2, 3, 4, 5]
    assert (run_dir / "metrics.torn.txt").read_text() == fragment + "\n"


def _recorded(tag_dir: Path, name: str) -> int:
    return json.loads((tag_dir / "crate_clip.json").read_text())["file_checksums"][name]["bytes"]


def _port() -> int:
    from crate_clip.train.stage_setup.engine import _free_port
    return _free_port()


def test_an_explicit_damaged_checkpoint_is_an_error_and_each_kind_of_damage_is_found(raced, tmp_path, capsys):
    """`--resume <tag folder>` of a damaged checkpoint names the file and the fix (another checkpoint is never taken
    silently); each kind of damage, and a crate_clip.json that does not parse, is found."""
    from crate_clip.train.checkpointing.checkpoints import CheckpointManager, ResumeError
    from crate_clip.train.checkpointing.checkpoints import checkpoint_damage, intact_checkpoint

    ckpts = tmp_path / "checkpoints"
    shutil.copytree(raced["run_dir"] / "checkpoints", ckpts)
    manager = CheckpointManager(ckpts, keep_last=4, rank=0, world_size=1)
    newest, before = ckpts / TAGS[6], ckpts / TAGS[5]
    assert checkpoint_damage(manager, newest) == [] and intact_checkpoint(manager, newest, "latest") == newest

    states = newest / "mp_rank_00_model_states.pt"
    size = states.stat().st_size
    with open(states, "r+b") as f:   # the same size, other bytes
        f.seek(size // 3)
        f.write(b"\0" * 16)
    assert checkpoint_damage(manager, newest) == [f"{states.name}: sha256 differs from the one crate_clip.json records"]
    with pytest.raises(ResumeError, match=rf"--resume {newest}: the checkpoint is damaged \({states.name}: sha256 "
                                          r"differs .*\); fix: resume with --resume latest"):
        intact_checkpoint(manager, newest, str(newest))
    assert intact_checkpoint(manager, newest, "latest") == before

    (newest / "train_state_rank00000.pt").unlink()
    assert "train_state_rank00000.pt: missing, but crate_clip.json records its checksum" in checkpoint_damage(
        manager, newest)
    (newest / "crate_clip.json").write_text('{"stage_index": 0, "st')   # a damaged record: said, not skipped
    assert manager.resolve("latest") == before
    with pytest.raises(ResumeError, match=r"not a complete checkpoint \(its crate_clip.json does not parse: damaged\)"):
        manager.resolve(str(newest))
    capsys.readouterr()
    assert intact_checkpoint(manager, before, "latest") == before
    assert capsys.readouterr().out == (f"[warn] {TAGS[6]} is damaged (crate_clip.json does not parse); resuming from "
                                       f"{TAGS[5]}, the newest intact checkpoint in {ckpts}\n")


def test_a_resume_that_could_not_save_says_so_before_training(raced, tmp_path, monkeypatch):
    """Resuming in place on a disk with less free space than a checkpoint takes: one line, before any step."""
    import shutil as shutil_module

    from crate_clip.train.run import disk_space

    tag_dir = raced["run_dir"] / "checkpoints" / TAGS[6]
    needed = disk_space.checkpoint_bytes(tag_dir)
    assert needed > 60 * 2 ** 20
    usage = shutil_module.disk_usage(tmp_path)
    full_disk = usage._replace(free=2 ** 20)   # what statvfs says of a disk with 1 MiB left
    monkeypatch.setattr(disk_space.shutil, "disk_usage", lambda path: full_disk)
    with pytest.raises(disk_space.NoSpaceError) as full:
        disk_space.check_space_for_next_save(tag_dir.parent, tag_dir)
    assert str(full.value) == (f"no space left on {tag_dir.parent} for the next checkpoint: it takes about "
                               f"{needed / 2 ** 20:.1f} MiB (the size of {TAGS[6]}), 1.0 MiB are free; free at least "
                               f"{(int(needed * 1.05) - 2 ** 20) / 2 ** 20:.1f} MiB there and resume (--resume latest)")
    assert full.value.exit_code == 6
