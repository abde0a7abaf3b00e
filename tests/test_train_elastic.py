"""Elastic training: a checkpoint of a 2-process run resumes at 1 and at 4 processes, also under another ZeRO
stage and another number of loader workers, and continues exactly; a run restarts by itself (--resume auto).

Two uninterrupted 2-process runs of the tiny model, fp32, 16 steps of 16 samples, a checkpoint every 4 steps
(elastic_workers.py records every batch's sample keys and the engine state):
- ZeRO-2, resampled shards;
- ZeRO-3, epoch mode (8 shards of 24 samples: 12 steps per epoch), a locked pretrained text tower.
Each resumes at 1 and at 4 processes: the ZeRO-3 run from its step-4 checkpoint (12 global batches after it, across
the epoch end after step 12), the ZeRO-2 run from its step-12 checkpoint (4 batches; resampled shards have no epoch
end). Exact: the fp32 master weights, AdamW moments, step counts, optimizer-group settings, lr and schedule
position, the locked text tower's buffers right after the load, and the sample keys of the global batches after
it. Within tolerance: the losses of those steps (the same fp32 math, summed in another order over another number
of ranks).
Also: a conversion cut short is redone and the converted weights are zero_to_fp32's; --resume auto starts, takes
the newest complete checkpoint, passes over a half-written save, re-exports a finished run; a job that does not
fit is refused in one line; `crate-clip plan --resume`; and a torchrun --max-restarts 1 job whose rank 1 is
SIGKILLed mid-stage ends with the uninterrupted run's export, byte for byte.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import warm_python
from elastic_workers import global_batches, losses
from processes import process_with_env
from train_fixtures import (REPO_ROOT, ranks_cmd, read_jsonl, run_job, stand_in_run_env, tiny_config, torchrun_cmd,
                            write_config)

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

ELASTIC = Path(__file__).resolve().parent / "elastic_workers.py"
STEPS, EVERY, RESUME_AT = 16, 4, "stage0-step00000004"
# where each reference run is resumed at another world size: the epoch-mode run early enough to cross its epoch end,
# the resampled one late (its 4-process ZeRO-3 resume, 4 steps instead of 12, costs about half the CPU)
RESUMED_AT = {"zero2": 12, "zero3": 4}
LOSS_RTOL = 1e-5   # fp32 losses of the same steps, reduced over another number of ranks (measured: <= 2e-7)


def _elastic_cmd(nproc: int, config: Path, out: Path, *extra: str) -> list[str]:
    return ranks_cmd(nproc, str(config), str(out), *extra, script=ELASTIC)


def _config(root: Path, name: str, data: Path, zero_stage: int, mode: str, **model) -> Path:
    stages = [{"name": "low", "image_size": 16, "context_length": 16, "samples": 16 * STEPS, "global_batch": 16,
               "lr": 2e-3, "warmup_steps": 2}]
    cfg = tiny_config(root / name, data, zero_stage=zero_stage, precision="fp32", stages=stages, every_steps=EVERY,
                      evals=False, logging={"every_steps": 1, "progress": False, "tensorboard": False, "plot": False})
    cfg["checkpoint"]["keep_last"] = STEPS // EVERY
    cfg["data"].update(num_workers=0, canonical_streams=8, mode=mode, shuffle_buffer=20)
    cfg["model"].update(model)
    return write_config(cfg, root / f"{name}.yaml")


@pytest.fixture(scope="module")
def references(tmp_path_factory, fashion_mnist_dir):
    """The two uninterrupted 2-process runs, each started by `--resume auto` in an empty folder."""
    from crate_clip.models import create_clip
    from crate_clip.data.sources.fashion_mnist import write_fashion_mnist_shards

    root = tmp_path_factory.mktemp("elastic")
    write_fashion_mnist_shards(root / "data" / "train", split="train", samples_per_shard=24, limit=192,
                               source_dir=fashion_mnist_dir)
    torch.manual_seed(123)   # a text tower unlike the seed-3 model's: a lock that lost it would show
    torch.save(create_clip("CRATE-alpha-CLIPA-tiny", image_size=16, context_length=16).state_dict(), root / "text.pt")
    runs = {"zero2": _config(root, "zero2", root / "data", 2, "resampled"),
            "zero3": _config(root, "zero3", root / "data", 3, "epoch", text_pretrained=str(root / "text.pt"),
                             lock_text=True)}
    for name, config in runs.items():
        proc = run_job(_elastic_cmd(2, config, root / f"{name}.out", "--resume", "auto", "--dump-at", _tag(name)),
                       timeout=400)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
        assert "resuming from" not in proc.stdout + proc.stderr   # auto in an empty folder: a fresh start
    return root


def _tag(run: str) -> str:
    return f"stage0-step{RESUMED_AT[run]:08d}"


@pytest.mark.parametrize("run, nproc, zero_stage, workers", [
    ("zero2", 1, 2, 0), ("zero2", 4, 3, 0),   # ZeRO 2 -> 3 on more processes
    ("zero3", 1, 3, 2), ("zero3", 4, 2, 0),   # loader workers 0 -> 2; ZeRO 3 -> 2
])
def test_resume_at_another_world_size_continues_exactly(references, run, nproc, zero_stage, workers):
    name, ref_out, at = f"{run}_at{nproc}", references / f"{run}.out", RESUMED_AT[run]
    proc = run_job(_elastic_cmd(nproc, references / f"{run}.yaml", references / f"{name}.out", "--resume",
                                str(references / run / "checkpoints" / _tag(run)),
                                "--set", f"run.output_dir={references / name}",
                                "--set", f"deepspeed.zero_stage={zero_stage}", "--set", f"data.num_workers={workers}"),
                   timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]

    saved = json.loads((ref_out / "state_saved.json").read_text())
    loaded = json.loads((references / f"{name}.out" / "state_loaded.json").read_text())
    assert loaded["universal"] and loaded["shared_step_tensors"] == 0
    differ = [k for k in saved["tensors"] if loaded["tensors"].get(k) != saved["tensors"][k]]
    assert saved["tensors"] and not differ, differ[:5]   # fp32 weights, exp_avg, exp_avg_sq of every parameter
    assert loaded["buffers"] == saved["buffers"] and bool(saved["buffers"]) == (run == "zero3")  # the locked tower
    for key in ("steps", "groups", "lr", "schedule_step", "global_steps"):
        assert loaded[key] == saved[key], key
    assert saved["steps"] == [float(at)] and [g["weight_decay"] for g in saved["groups"]] == [0.2, 0.0]

    ref, got = global_batches(ref_out, 2), global_batches(references / f"{name}.out", nproc)
    assert len(got) == STEPS - at and all(ref[step] == keys for step, keys in got.items())
    assert {epoch for epoch, _ in got} == ({0} if run == "zero2" else {0, 1})   # epoch mode: across the epoch end
    ref_losses, got_losses = losses(references / run), losses(references / name)
    assert sorted(got_losses) == list(range(at + 1, STEPS + 1))
    for step, loss in got_losses.items():
        assert loss == pytest.approx(ref_losses[step], rel=LOSS_RTOL), step


def test_universal_conversion_is_staged_and_holds_the_saved_fp32_weights(references, tmp_path):
    """A conversion cut short is redone; the converted weights are zero_to_fp32's consolidation, bit for bit."""
    from crate_clip.checkpoint_io.deepspeed_checkpoints import consolidated_state_dict
    from crate_clip.train.checkpointing.elastic_resume import CONVERTED_FILE, UNIVERSAL_DIR, convert_to_universal

    tag = tmp_path / RESUME_AT
    shutil.copytree(references / "zero3" / "checkpoints" / RESUME_AT, tag, ignore=shutil.ignore_patterns("universal"))
    (tag / ".universal.converting").mkdir()   # what a conversion killed midway leaves
    (tag / ".universal.converting" / "junk").write_text("x")
    (tag / UNIVERSAL_DIR / "zero").mkdir(parents=True)   # renamed but never marked complete
    convert_to_universal(tag)
    assert (tag / UNIVERSAL_DIR / CONVERTED_FILE).is_file() and not (tag / ".universal.converting").exists()
    assert not (tag / "latest_universal").exists()
    weights = consolidated_state_dict(tag)
    params = [p.name for p in (tag / UNIVERSAL_DIR / "zero").iterdir() if (p / "exp_avg.pt").is_file()]
    assert params and "visual.trunk.pos_embed" in params and "token_embedding.weight" not in params  # text: locked
    for name in params:
        full = torch.load(tag / UNIVERSAL_DIR / "zero" / name / "fp32.pt", weights_only=True)["param"]
        assert torch.equal(full.reshape(-1), weights[name].reshape(-1)), name


def test_resume_auto_takes_the_newest_complete_checkpoint_or_starts(references, tmp_path):
    from crate_clip.train.checkpointing.checkpoints import CheckpointManager, find_resume_point
    from crate_clip.train.checkpointing.elastic_resume import resolve_auto
    from crate_clip.train.run.run_config import load_run_config
    from crate_clip.train.run.run_dir import ExistingRunError

    cfg = load_run_config(references / "zero2.yaml")
    root = tmp_path / "checkpoints"
    ckpts = CheckpointManager(root, 3, 0, 1)
    assert resolve_auto(tmp_path, ckpts, "auto") is None   # nothing there: start
    half = root / ".stage0-step00000008.saving"   # a save cut short: DeepSpeed's files, no crate_clip.json
    half.mkdir(parents=True)
    (half / "mp_rank_00_model_states.pt").write_bytes(b"")
    assert resolve_auto(tmp_path, ckpts, "auto") is None   # only a half-written save: start
    complete = root / RESUME_AT
    complete.mkdir()
    shutil.copy(references / "zero2" / "checkpoints" / RESUME_AT / "crate_clip.json", complete)
    (root / "latest").write_text("stage0-step00000008")   # names the half-written one: not taken
    start = find_resume_point(cfg, ckpts, resolve_auto(tmp_path, ckpts, "auto"))
    assert start.tag_dir == complete and start.progress.step == 4 and not start.stage_finished
    assert resolve_auto(tmp_path, ckpts, "latest") == "latest"   # other values pass unchanged

    finished = CheckpointManager(references / "zero2" / "checkpoints", 3, 0, 1)   # a finished run: as latest
    start = find_resume_point(cfg, finished, resolve_auto(references / "zero2", finished, "auto"))
    assert start.progress.step == STEPS and start.stage_finished

    (tmp_path / "export").mkdir()   # evaluations or an export without any checkpoint: not a run cut short
    with pytest.raises(ExistingRunError, match="holds export but no complete checkpoint.*fix: --overwrite"):
        resolve_auto(tmp_path, CheckpointManager(tmp_path / "none", 3, 0, 1), "auto")


def test_resume_auto_on_a_finished_run_exports_it_again_identically(references):
    """The finished 2-process run, relaunched with --resume auto in one process: nothing to train, exit 0."""
    export = references / "zero2" / "export" / "open_clip_model.safetensors"
    before = export.read_bytes()
    proc = run_job([sys.executable, "-m", "crate_clip.train.cli", "--config", str(references / "zero2.yaml"),
                    "--resume", "auto"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert f"resuming from {references / 'zero2' / 'checkpoints' / f'stage0-step{STEPS:08d}'}" in proc.stdout
    assert export.read_bytes() == before


def test_which_checkpoints_need_the_universal_form(tmp_path):
    """Another world size or ZeRO stage with partitioned optimizer states: universal; ZeRO-0 (nothing partitioned):
    DeepSpeed's plain load at any world size; a change to or from ZeRO-0: refused in one line."""
    from crate_clip.train.checkpointing.checkpoints import ResumeError
    from crate_clip.train.checkpointing.elastic_resume import needs_universal

    (tmp_path / "crate_clip.json").write_text(json.dumps({"world_size": 2, "zero_stage": 0}))
    assert not needs_universal(tmp_path, 2, 0) and not needs_universal(tmp_path, 1, 0)
    with pytest.raises(ResumeError, match="written under ZeRO stage 0 by 2 processes; this job runs ZeRO stage 2 on 1"):
        needs_universal(tmp_path, 1, 2)
    (tmp_path / "crate_clip.json").write_text(json.dumps({"world_size": 2, "zero_stage": 2}))
    (tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"")
    assert not needs_universal(tmp_path, 2, 2)
    assert needs_universal(tmp_path, 4, 2) and needs_universal(tmp_path, 2, 3) and needs_universal(tmp_path, 1, 1)
    with pytest.raises(ResumeError, match="fix: deepspeed.zero_stage: 2"):
        needs_universal(tmp_path, 1, 0)


def test_a_job_the_canonical_streams_do_not_fit_is_refused_in_one_line(references, tmp_path):
    from crate_clip.core.errors import report_error
    from crate_clip.train.checkpointing.checkpoints import ResumeError
    from crate_clip.train.stage_setup.engine import DistInfo
    from crate_clip.train.run.run_config import load_run_config
    from crate_clip.train.loop.stage_loop import run_training

    ckpt = references / "zero2" / "checkpoints" / RESUME_AT
    cfg = load_run_config(references / "zero2.yaml", [f"run.output_dir={tmp_path / 'run'}", "data.num_workers=3"])
    with pytest.raises(ResumeError) as caught:   # checked before any collective: no process group needed
        run_training(cfg, resume=str(ckpt), dist=DistInfo(rank=0, world_size=1, local_rank=0, device="cpu"))
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"{ckpt}: resuming with 1 processes: stages.0: ")
    assert "data.canonical_streams=8 is not divisible by world_size x num_workers = 1 x 3" in message
    assert "fix: data.num_workers a divisor of 8" in message and report_error("t", caught.value) == 4
    cfg = load_run_config(references / "zero2.yaml", [f"run.output_dir={tmp_path / 'run'}",
                                                      "data.canonical_streams=4"])
    with pytest.raises(ResumeError, match=r"written with data\.canonical_streams=8 .*fix: data\.canonical_streams: 8"):
        run_training(cfg, resume=str(ckpt), dist=DistInfo(rank=0, world_size=1, local_rank=0, device="cpu"))
    assert not (tmp_path / "run").exists()   # refused before anything was written


def test_plan_for_a_run_in_progress_at_another_gpu_count(references, capsys):
    from crate_clip.cli import main

    ckpt = references / "zero2" / "checkpoints" / _tag("zero2")   # converted by the 4-process resume
    assert main(["plan", "--resume", str(ckpt), "--gpus", "4", "--gpu-memory", "1GiB", "--no-memory",
                 "--set", "deepspeed.zero_stage=3"]) == 0
    out = capsys.readouterr().out
    at = RESUMED_AT["zero2"]
    assert f"resume: {ckpt} (stage 0 low, step {at} of {STEPS}, global step {at}; written by 2 processes under ZeRO-2)" \
        in out
    assert "on 4 GPUs: ZeRO-3, canonical streams 8 (2 per rank), DeepSpeed universal checkpoint: converted" in out
    assert "micro-batch       4 per rank, k = 1" in out
    assert main(["plan", "--resume", str(references / "zero2"), "--gpus", "3", "--gpu-memory", "1GiB"]) == 2
    assert "stages.0.global_batch: 16 is not divisible by the 3 processes" in capsys.readouterr().err


def test_torchrun_restarts_a_killed_rank_and_ends_with_the_uninterrupted_export(references, tmp_path, request):
    run_dir = tmp_path / "run"
    cmd = torchrun_cmd(2, "--config", str(references / "zero2.yaml"), "--set", f"run.output_dir={run_dir}",
                       "--resume", "auto", module="crate_clip.train.cli")
    at = cmd.index("--master_addr")
    cmd[at:at] = ["--max-restarts", "1"]
    # torchrun's workers are stand-ins for warm commands (tests/README.md): killing one kills its command
    env = stand_in_run_env(request)
    proc = warm_python.Popen(cmd, env=env, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, start_new_session=True)
    killed, deadline, metrics = None, time.time() + 300, run_dir / "metrics.jsonl"
    while killed is None and time.time() < deadline and proc.poll() is None:
        steps = [r["step"] for r in read_jsonl(metrics)] if metrics.exists() else []
        if steps and max(steps) >= EVERY + 2:   # after the step-4 checkpoint, mid-stage
            # the rank torchrun's agent started: a stand-in with this test's variables, not the test's grandchild
            killed = process_with_env("RANK=1", f"WARM_CPU_FILE={env['WARM_CPU_FILE']}")
            if killed:
                os.kill(killed, signal.SIGKILL)
        time.sleep(0.02)
    out, err = proc.communicate(timeout=400)
    assert killed and proc.returncode == 0, out[-3000:] + err[-6000:]
    assert re.search(r"resuming from .*stage0-step0000000[48]", out), out[-3000:]
    assert sorted(r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")) == list(range(1, STEPS + 1))
    name = "open_clip_model.safetensors"
    assert (run_dir / "export" / name).read_bytes() == (references / "zero2" / "export" / name).read_bytes()
