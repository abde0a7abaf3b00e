"""The stop machinery outside Slurm (stop_requests.py; under a real Slurm: test_slurm_preemption.py): which signals
--save-on-signal takes; a data source given up on by one rank of two (an error with `checkpoint_before_exit`) makes
both ranks save the last completed step at the same data position and exit with that error's code and line; a
signal to one rank of two during a save lets the save finish and stops both after that step, exit 8; a signal to one
rank while the other is held in a retried remote read reaches that one within seconds (stop_sharing.py)."""
import json
import signal

import pytest

from crate_clip.checkpoint_io.deepspeed_checkpoints import verify_checkpoint
from crate_clip.train.loop.stop_requests import parse_signals
from train_fixtures import REPO_ROOT, ranks_cmd, read_jsonl, run_job, tiny_config, write_config


def test_save_on_signal_names_and_numbers():
    assert parse_signals("USR1,TERM") == (signal.SIGUSR1, signal.SIGTERM)
    assert parse_signals("sigusr2, 15") == (signal.SIGUSR2, signal.SIGTERM)
    assert parse_signals("none") == () and parse_signals("") == ()
    with pytest.raises(ValueError, match="'BOGUS' is no signal"):
        parse_signals("USR1,BOGUS")
    with pytest.raises(ValueError, match="SIGKILL cannot be caught"):
        parse_signals("KILL")


def _two_ranks(tmp_path, data, mode: str, rank: int, at_batch: int, every_steps: int = 0):
    """The tiny one-stage run (10 steps, a checkpoint every `every_steps`) on 2 ranks, `mode` on `rank`
    (stop_workers.py)."""
    stage = {"name": "low", "image_size": 16, "context_length": 16, "samples": 160, "global_batch": 16, "lr": 2e-3,
             "warmup_steps": 1}
    cfg = tiny_config(tmp_path / "run", data, precision="fp32", stages=[stage], evals=False, every_steps=every_steps,
                      logging={"every_steps": 1, "progress": False, "tensorboard": False, "plot": False})
    cfg["data"]["num_workers"] = 0
    config = write_config(cfg, tmp_path / "run.yaml")
    done = run_job(ranks_cmd(2, str(config), mode, str(rank), str(at_batch),
                             script=REPO_ROOT / "tests" / "stop_workers.py"), timeout=180)
    lines = [line for line in done.stderr.splitlines() if line.startswith("crate-clip train:")]
    return done, lines, (done.stdout + done.stderr)[-4000:]


@pytest.mark.multiproc
@pytest.mark.slow
def test_a_source_given_up_on_one_rank_saves_every_rank_at_the_same_step_and_exits_with_its_code(
        tiny_fmnist, tmp_path):
    done, lines, out = _two_ranks(tmp_path, tiny_fmnist, "source", 1, 4)
    assert done.returncode == 7, out
    assert len(lines) == 1 and "http://shards.invalid/{0..2}.tar: unreachable" in lines[0], out
    assert "step00000003" in lines[0] and lines[0].count("--resume latest") == 1, lines
    ckpt = tmp_path / "run" / "checkpoints" / "stage0-step00000003"
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text().strip() == ckpt.name
    assert [r["step"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")] == [1, 2, 3]
    # rank 0 had fetched its 4th batch when rank 1's source failed: its saved position is still after batch 3
    table = json.loads((ckpt / "stream_table.json").read_text())
    assert table["batches"] == 3, {k: v for k, v in table.items() if k != "streams"}
    assert not (tmp_path / "run.lock").exists()


@pytest.mark.multiproc
@pytest.mark.slow
def test_a_signal_to_one_rank_during_a_save_lets_it_finish_and_stops_both_after_that_step_with_exit_8(
        tiny_fmnist, tmp_path):
    # SIGTERM to rank 1 only, as its periodic save of step 3 starts (rank 0 holds the lock)
    done, lines, out = _two_ranks(tmp_path, tiny_fmnist, "signal", 1, 3, every_steps=3)
    assert done.returncode == 8, out
    assert len(lines) == 1 and lines[0].startswith("crate-clip train: stopped by SIGTERM"), out
    assert "step 3," in lines[0] and "stage0-step00000003" in lines[0], lines
    ckpts = tmp_path / "run" / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "stage0-step00000003"   # the save finished, and was not redone
    assert sorted(p.name for p in ckpts.iterdir() if p.name.startswith("stage")) == ["stage0-step00000003"]
    assert verify_checkpoint(ckpts / "stage0-step00000003").progress.step == 3   # whole: every file's size and sha256
    assert [r["step"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")] == [1, 2, 3]
    assert not (tmp_path / "run.lock").exists() and not (tmp_path / "run" / "export").exists()


@pytest.mark.multiproc
@pytest.mark.slow
def test_a_signal_to_one_rank_stops_the_other_held_in_a_retried_read_within_seconds(tiny_fmnist, tmp_path):
    """Rank 1 retries a refused remote shard (a 10-minute budget) at its 3rd batch; rank 0, waiting for it in the
    step's collective, gets SIGTERM: the stop reaches rank 1 through the job's store, breaks its retry off, and both
    save the 2 completed steps and exit 8 (run_job's timeout is the bound: a missed stop would take 10 minutes)."""
    done, lines, out = _two_ranks(tmp_path, tiny_fmnist, "stuck", 1, 3)
    assert done.returncode == 8, out
    assert len(lines) == 1 and lines[0].startswith("crate-clip train: stopped by SIGTERM"), out
    assert "step 2," in lines[0] and "stage0-step00000002" in lines[0] and "Traceback" not in out, out
    table = json.loads((tmp_path / "run" / "checkpoints" / "stage0-step00000002" / "stream_table.json").read_text())
    assert table["batches"] == 2 and not (tmp_path / "run.lock").exists()
