"""NaN / inf losses: a non-finite loss on ONE rank skips the step on every rank (weights untouched) and is
counted; K in a row stop the run with a message naming the step and a checkpoint that loads."""
import math

import pytest
import torch

from train_fixtures import ranks_cmd, read_jsonl, run_job, tiny_config, write_config

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]


def test_nonfinite_steps_are_skipped_counted_and_stop_the_run(tiny_fmnist, tmp_path):
    from crate_clip.train.checkpointing.checkpoints import consolidated_state_dict, read_info

    run_dir = tmp_path / "run"
    stages = [{"name": "only", "image_size": 16, "context_length": 16, "samples": 320, "global_batch": 16,
               "lr": 2e-3, "warmup_steps": 1}]
    # fp32: this CPU has no native bf16 (3.5x slower matmuls); the bf16 skip path (ZeRO-2, weights kept) is
    # checked by test_train_accumulation.py's gradpoison case, the lock and resume runs train in bf16
    cfg = tiny_config(run_dir, tiny_fmnist, precision="fp32", stages=stages, every_steps=6, evals=False,
                      run={"max_nonfinite_in_a_row": 3})
    proc = run_job(ranks_cmd(2, "nonfinite", str(write_config(cfg, tmp_path / "run.yaml"))), timeout=240)
    out = proc.stdout + proc.stderr
    assert "NONFINITE-STOP" in out, out[-6000:]
    # rank 1 saw NaN at batch 3 (one skip), then inf/NaN at 7, 8, 9: the third in a row stops the run
    assert "3 non-finite losses in a row" in out and "stage 0 (only) step 9" in out
    assert "stage0-step00000009" in out and "run.max_nonfinite_in_a_row" in out

    records = {r["step"]: r for r in read_jsonl(run_dir / "metrics.jsonl")}
    assert records[2]["loss"] is not None and records[3]["loss"] is None
    assert records[3]["nonfinite_skipped"] == 1 and records[4]["nonfinite_skipped"] == 1
    assert records[9]["nonfinite_skipped"] == 4 and max(records) == 9
    assert all(math.isfinite(records[s]["loss"]) for s in (1, 2, 4, 5, 6))
    assert "data_skips" in records[1]
    # throughput accounting (CPU: TFLOP/s counted, no MFU)
    perf = records[2]
    assert perf["tflops"] > 0 and perf["tokens_per_s"] > perf["samples_per_s_window"] > 0
    assert perf["mfu"] is None and perf["peak_memory_gib_max_rank"] > 0.1
    assert 0 <= perf["data_wait_frac"] < 1 and perf["step_time_s"] > perf["data_wait_s"] >= 0

    ckpts = run_dir / "checkpoints"
    assert (ckpts / "latest").read_text() == "stage0-step00000009"
    assert read_info(ckpts / "stage0-step00000009")["nonfinite_skipped"] == 4
    at6, at9 = consolidated_state_dict(ckpts / "stage0-step00000006"), consolidated_state_dict(ckpts / "stage0-step00000009")
    for key, value in at9.items():
        assert torch.isfinite(value).all(), key
        assert torch.equal(value, at6[key]), key  # steps 7-9 were skipped: the weights did not move
    assert not (run_dir / "export").exists()
