"""Two-process training of the tiny CRATE-alpha CLIP on real Fashion-MNIST shards, end to end:
a run killed with SIGKILL in the middle of a stage and resumed ends exactly like an uninterrupted run (also
the demo's own config, killed in the stage that inherits its patch size: one process, its reference run in this
one); the stage transition resizes the position embeddings; the zero-shot hook runs after each stage (at the
stage's and at the full resolution); the export loads through open_clip's local-dir loader; the throughput records
carry the tokens and FLOPs per sample of the model that trains."""
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

import warm_python
from processes import descendants
from train_fixtures import (REPO_ROOT, TINY_EVAL_IMAGES, default_stages, ranks_cmd, read_jsonl, run_env, run_job,
                            tiny_config, train_in_process, write_config)

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

CKPT_EVERY = 3
KILL_AT_STEP = 5  # of stage 0's 10 steps: after the step-3 checkpoint, before the stage ends


def _train_cmd(config: Path, *extra: str) -> list[str]:
    return ranks_cmd(2, "--config", str(config), *extra, module="crate_clip.train.cli")


def _sigkill_job(proc: subprocess.Popen) -> list[int]:
    """SIGKILL the launcher and both training processes at once: no clean-up code runs anywhere. Returns the
    processes signalled."""
    pids = [proc.pid, *descendants(proc.pid)]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return pids


def _wait_gone(pids: list[int], timeout: float = 30.0) -> None:
    """Until every process in `pids` has exited (zombies count as exited): an awaited event, not a fixed sleep."""
    from crate_clip.train.run.process_info import is_running

    deadline = time.time() + timeout
    while any(is_running(pid) for pid in pids) and time.time() < deadline:
        time.sleep(0.02)
    assert not any(is_running(pid) for pid in pids), [pid for pid in pids if is_running(pid)]


def _losses(run_dir: Path) -> dict:
    """(stage, step) -> loss, the last record of each step (a resumed run re-logs the steps it redoes)."""
    return {(r["stage_index"], r["step"]): r["loss"] for r in read_jsonl(run_dir / "metrics.jsonl")}


def _export(run_dir: Path) -> dict:
    from safetensors.torch import load_file
    return load_file(str(run_dir / "export" / "open_clip_model.safetensors"))


def _masked_stages() -> list[dict]:
    """The default stages with 30% of the patch tokens dropped at random in the first: the resumed run must
    draw the same masks (and the same data) as the uninterrupted one."""
    stages = default_stages()
    stages[0].update(image_mask="random", image_mask_ratio=0.3)
    return stages


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory, tiny_fmnist):
    """The uninterrupted run (2 stages, ZeRO-2, bf16, checkpoints every 3 steps)."""
    root = tmp_path_factory.mktemp("reference")
    cfg = write_config(tiny_config(root / "run", tiny_fmnist, stages=_masked_stages(), every_steps=CKPT_EVERY),
                       root / "run.yaml")
    proc = run_job(_train_cmd(cfg), timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return root / "run"


def _kill_at(cmd: list[str], run_dir: Path, stage: int, step: int) -> list[int]:
    """Run the job until metrics.jsonl holds `step` of `stage`, then SIGKILL it; returns the steps it logged."""
    proc = warm_python.Popen(cmd, env=run_env(), cwd=REPO_ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    metrics, deadline, killed = run_dir / "metrics.jsonl", time.time() + 300, []
    try:
        while time.time() < deadline and proc.poll() is None:
            steps = [r["step"] for r in read_jsonl(metrics) if r["stage_index"] == stage] if metrics.exists() else []
            if steps and max(steps) >= step:
                killed = _sigkill_job(proc)
                break
            time.sleep(0.02)
    finally:
        if proc.poll() is None:
            killed = _sigkill_job(proc)
        proc.wait()
        _wait_gone(killed)   # (was: fixed sleeps of 1.5 s) no process of the job is left to write anything
    assert proc.returncode == -signal.SIGKILL
    assert not (run_dir / "export").exists()
    return [r["step"] for r in read_jsonl(metrics)]


def test_sigkill_mid_stage_then_resume_matches_uninterrupted(reference_run, tiny_fmnist, tmp_path):
    run_dir = tmp_path / "run"
    cfg = write_config(tiny_config(run_dir, tiny_fmnist, stages=_masked_stages(), every_steps=CKPT_EVERY),
                       tmp_path / "run.yaml")
    killed_steps = _kill_at(_train_cmd(cfg), run_dir, 0, KILL_AT_STEP)
    latest = (run_dir / "checkpoints" / "latest").read_text()
    assert latest.startswith("stage0-") and latest != "stage0-step00000010", latest  # killed mid-stage

    resumed = run_job(_train_cmd(cfg, "--resume", "latest"), timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-6000:]
    assert f"resuming from {run_dir / 'checkpoints' / latest}" in resumed.stdout + resumed.stderr

    ref_losses, got_losses = _losses(reference_run), _losses(run_dir)
    assert len(ref_losses) == 10 + 4 and set(got_losses) == set(ref_losses)
    # one row per step for every reader: the rows the killed segment logged after its checkpoint are set aside
    keys = [(r["stage_index"], r["step"]) for r in read_jsonl(run_dir / "metrics.jsonl")]
    assert sorted(keys) == sorted(ref_losses)
    superseded = [(r["stage_index"], r["step"]) for r in read_jsonl(run_dir / "metrics.superseded.jsonl")]
    assert superseded == [(0, s) for s in killed_steps if s > int(latest.split("step")[1])] and superseded
    for key, value in ref_losses.items():
        assert got_losses[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    ref, got = _export(reference_run), _export(run_dir)
    assert set(ref) == set(got)
    for key in ref:
        torch.testing.assert_close(got[key], ref[key], rtol=1e-5, atol=1e-6, msg=key)


def test_stage_transition_resizes_pos_embed_and_evaluates(reference_run):
    from crate_clip.train.checkpointing.checkpoints import consolidated_state_dict

    ckpts = reference_run / "checkpoints"
    tags = sorted(p.name for p in ckpts.iterdir() if (p / "crate_clip.json").is_file())
    # retention: keep_last=3 complete checkpoints (stage 0's end among them); latest names the newest
    assert tags == ["stage0-step00000010", "stage1-step00000003", "stage1-step00000004"]
    assert (ckpts / "latest").read_text() == "stage1-step00000004"
    low, full = consolidated_state_dict(ckpts / tags[0]), consolidated_state_dict(ckpts / tags[-1])
    width = full["visual.trunk.pos_embed"].shape[-1]
    assert full["visual.trunk.pos_embed"].shape == (1, 7 * 7 + 1, width)  # 28 px / patch 4, + cls
    assert low["visual.trunk.pos_embed"].shape == (1, 4 * 4 + 1, width)  # 16 px
    assert full["logit_scale"].shape == (1,)

    results = read_jsonl(reference_run / "results.jsonl")
    seen = {(r["stage_index"], r["image_size"]) for r in results}
    assert seen == {(0, 16), (0, 28), (1, 28)}  # low-res stage: its own and the full resolution
    for r in results:  # the hook ran on every test image, all 10 classes (14 tiny steps: no accuracy claim)
        assert r["n_images"] == TINY_EVAL_IMAGES and 0.0 <= r["top1"] <= r["top5"] <= 1.0 and len(r["per_class"]) == 10
        assert r["samples_seen"] == (160 if r["stage_index"] == 0 else 224)
    assert (reference_run / "training_curve.png").stat().st_size > 10_000
    assert list((reference_run / "tensorboard").glob("events.*"))


def test_export_loads_with_open_clip_local_dir(reference_run):
    import open_clip

    from crate_clip.export.writer import load_export

    model, preprocess, tokenizer = load_export(reference_run / "export")
    weights = _export(reference_run)
    own = model.state_dict()
    assert set(own) == set(weights)
    for key, value in weights.items():
        assert torch.equal(own[key].float().reshape(-1), value.reshape(-1)), key
    assert own["logit_scale"].shape == ()
    assert model.visual.image_size == (28, 28)
    with torch.no_grad():
        feats = model.encode_text(tokenizer(["a photo of a sneaker."]))
    assert feats.shape == (1, model.text_projection.shape[1]) and torch.isfinite(feats).all()
    from PIL import Image
    pixels = preprocess(Image.new("RGB", (40, 30), (128, 128, 128)))   # resized, center-cropped, normalized
    mean, std = torch.tensor(open_clip.OPENAI_DATASET_MEAN), torch.tensor(open_clip.OPENAI_DATASET_STD)
    torch.testing.assert_close(pixels, ((128 / 255 - mean) / std)[:, None, None].expand(3, 28, 28))


def test_crate_clip_export_of_any_checkpoint_and_of_the_last_is_the_trainers_export(reference_run, tmp_path,
                                                                                      capsys):
    """`crate-clip export` of a mid-run ZeRO-2 checkpoint reloads through open_clip with its consolidated weights;
    of the run folder (the checkpoint `latest` names: the run's last) it writes the trainer's export byte for byte."""
    import json

    from crate_clip.cli import main
    from crate_clip.train.checkpointing.checkpoints import consolidated_state_dict
    from crate_clip.export.writer import export_state_equal, load_export

    assert main(["export", str(reference_run), "--out", str(tmp_path / "final"), "--no-verify"]) == 0
    files = sorted(p.name for p in (reference_run / "export").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "final").iterdir()) and "README.md" in files
    for name in files:
        assert (tmp_path / "final" / name).read_bytes() == (reference_run / "export" / name).read_bytes(), name

    mid = reference_run / "checkpoints" / "stage1-step00000003"
    assert main(["export", str(mid), "--out", str(tmp_path / "mid")]) == 0   # verifies the reload itself too
    assert export_state_equal(load_export(tmp_path / "mid")[0], consolidated_state_dict(mid))
    capsys.readouterr()
    assert main(["export", str(reference_run / "checkpoints"), "--stage", "0", "--out", str(tmp_path / "s0"),
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {   # stdout holds the result alone; the verdict is in it
        "out": str(tmp_path / "s0"), "checkpoint": str(reference_run / "checkpoints" / "stage0-step00000010"),
        "load": f"local-dir:{tmp_path / 's0'}", "stage": 0, "step": 10, "image_size": 16, "verified": True}
    config = json.loads((tmp_path / "s0" / "open_clip_config.json").read_text())
    assert config["model_cfg"]["vision_cfg"]["image_size"] == config["preprocess_cfg"]["size"] == 16
    card = (tmp_path / "s0" / "README.md").read_text()
    assert "checkpoint `stage0-step00000010`" in card and "stage 1 (full)" not in card and "stage 0 (low)" in card


# ---------------------------------------------------------------- the demo's config, shortened
DEMO_CONFIG = REPO_ROOT / "configs" / "demo" / "fashion_mnist.yaml"
DEMO_KILL_AT = 3   # of stage 1's 6 steps: after its step-2 checkpoint, before the stage ends
# train.ema on (docs/training.md, "EMA of the weights"): started at step 1, taken in at steps 3 and 5 of stage 1, so
# the resume from its step-2 checkpoint goes on from a saved average that has not yet taken in a step
DEMO_EMA = {"train.ema.decay": 0.9, "train.ema.every_steps": 2, "train.ema.start_step": 1}


def _demo_sets(run_dir: Path, data: Path) -> list[str]:
    """The demo config (stage 0: 21 px at patch 7; stage 1: 28 px, inheriting patch 7: the demo's own stage 1 sets
    27 px at patch 9; here 28 px with patch_size unset, so patch 7 is inherited and the grid grows to 4x4) cut to 3 + 6
    steps of 32 samples on the small data set, a checkpoint every 2 steps, every step logged: its `--set`s."""
    sets = {"run.output_dir": str(run_dir), "data.sources": json.dumps([str(data / "train")]),
            "data.shuffle_buffer": 100, "eval.evals.0.data": str(data / "test"), "eval.evals.0.batch_size": 100,
            "stages.0.samples": 96, "stages.1.samples": 192, "stages.0.global_batch": 32,
            "stages.1.global_batch": 32, "stages.1.patch_size": "null", "stages.1.image_size": 28,
            "eval.full_image_size": 28, "stages.0.warmup_steps": 1,
            "stages.1.warmup_steps": 1,
            "checkpoint.every_steps": 2, "logging.every_steps": 1, "logging.progress": "false",
            "logging.diagnostics_images": 8, **DEMO_EMA}
    return [f"{k}={v}" for k, v in sets.items()]


def _demo_cmd(run_dir: Path, data: Path, *extra: str) -> list[str]:
    """The shortened demo as one training process (the scenario is a kill in a stage that inherits its patch size,
    not the ranks; two ranks resuming exactly is the SIGKILL test above), forked by fork_ranks as a launcher."""
    sets = [a for assignment in _demo_sets(run_dir, data) for a in ("--set", assignment)]
    return ranks_cmd(1, "--config", str(DEMO_CONFIG), *sets, *extra, module="crate_clip.train.cli")


@pytest.fixture(scope="module")
def demo_reference(tmp_path_factory, tiny_fmnist):
    """The shortened demo, uninterrupted, in this process (a world of one, as the killed job's)."""
    run_dir = tmp_path_factory.mktemp("demo_reference") / "run"
    train_in_process(DEMO_CONFIG, _demo_sets(run_dir, tiny_fmnist))
    return run_dir


def test_demo_killed_in_its_inherited_patch_stage_resumes_bit_for_bit(demo_reference, tiny_fmnist, tmp_path):
    run_dir = tmp_path / "run"
    _kill_at(_demo_cmd(run_dir, tiny_fmnist), run_dir, 1, DEMO_KILL_AT)
    latest = (run_dir / "checkpoints" / "latest").read_text()
    assert latest.startswith("stage1-") and latest != "stage1-step00000006", latest   # killed mid stage 1
    assert json.loads((run_dir / "checkpoints" / latest / "crate_clip.json").read_text())["patch_size"] == 7
    # a run config whose stage 1 has other shapes than the checkpoint (an allowed change, test_train_config_changes):
    # one line naming the first mismatch and the fix, exit code 4 (the launcher's: fork_ranks passes the failing
    # rank's on), no traceback of ours; the change is not recorded and the run folder stays resumable
    changed = run_job(_demo_cmd(run_dir, tiny_fmnist, "--set", "stages.1.patch_size=4", "--allow-change",
                                "stages.1.patch_size", "--resume", "latest"))
    lines = [line for line in changed.stderr.splitlines() if line.startswith("crate-clip train: ")]
    assert lines and all("its weights do not fit stage 1 (fullres)" in line and "size mismatch for "
                         "visual.trunk.patch_embed.proj.weight" in line and "fix:" in line for line in lines), \
        changed.stderr[-6000:]
    assert changed.returncode == 4 and "crate_clip/train/" not in changed.stderr
    assert not (run_dir / "config_changes.jsonl").exists()

    resumed = run_job(_demo_cmd(run_dir, tiny_fmnist, "--resume", "latest"), timeout=400)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-6000:]
    assert f"resuming from {run_dir / 'checkpoints' / latest}" in resumed.stdout + resumed.stderr
    assert _losses(run_dir) == _losses(demo_reference) and len(_losses(run_dir)) == 3 + 6
    ref, got = _export(demo_reference), _export(run_dir)
    assert set(ref) == set(got) and all(torch.equal(got[k], ref[k]) for k in ref)
    from crate_clip.checkpoint_io.ema_state import ema_state_of_checkpoint
    for tag in ("stage0-step00000003", "stage1-step00000006"):   # each stage's average, tensor for tensor
        want, have = (ema_state_of_checkpoint(run / "checkpoints" / tag) for run in (demo_reference, run_dir))
        assert want and set(have) == set(want) and all(torch.equal(have[k], want[k]) for k in want), tag


def test_the_ema_weights_are_evaluated_beside_the_live_ones_and_exported_with_weights_ema(demo_reference,
                                                                                         reference_run, tmp_path,
                                                                                         capsys):
    """train.ema's average: the stage-end evaluations run on it too (rows `"weights": "ema"`), `crate-clip export
    --weights ema` writes it in place of the trained parameters (the default export stays the live weights), and a
    checkpoint without one is refused in one line before its shards are read."""
    from crate_clip.checkpoint_io.ema_state import ema_state_of_checkpoint, with_ema
    from crate_clip.cli import main
    from crate_clip.export.writer import export_state_equal, load_export
    from crate_clip.train.checkpointing.checkpoints import consolidated_state_dict

    rows = [r for r in read_jsonl(demo_reference / "results.jsonl") if r.get("at", "stage_end") == "stage_end"]
    points = {kind: sorted((r["stage_index"], r["image_size"], r["resize"]) for r in rows
                           if r.get("weights", "live") == kind) for kind in ("live", "ema")}
    assert points["ema"] == points["live"] and len(points["live"]) >= 3, points
    last = demo_reference / "checkpoints" / "stage1-step00000006"
    live, ema = consolidated_state_dict(last), ema_state_of_checkpoint(last)
    assert main(["export", str(demo_reference), "--weights", "ema", "--out", str(tmp_path / "ema")]) == 0
    exported = load_export(tmp_path / "ema")[0]
    assert export_state_equal(exported, with_ema(live, ema)) and not export_state_equal(exported, live)
    card = (tmp_path / "ema" / "README.md").read_text()
    assert "exponential moving average of the trained weights" in card
    assert export_state_equal(load_export(demo_reference / "export")[0], live)   # the run's own export: live
    capsys.readouterr()
    assert main(["export", str(reference_run), "--weights", "ema", "--out", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds no EMA weights" in err[0] and "fix:" in err[0], err
    assert not (tmp_path / "none").exists()


def test_demo_stages_log_the_tokens_and_flops_of_the_model_that_trains(demo_reference):
    """Stage 0 runs at 21 px with 7 px patches, 3 of its 9 patch tokens kept (the demo's random mask) and 8 text
    tokens; stage 1 at 28 px with the patch size it inherits (16 patches) and 16 text tokens; each record's FLOPs per
    sample are what torch's counter counts on that model as it trains (in train mode, the mask drawn)."""
    from torch.utils.flop_counter import FlopCounterMode

    from crate_clip.models import create_clip
    from crate_clip.models.clip_factory import set_image_token_mask
    from crate_clip.train.loop.train_step import attention_kernel

    rows = read_jsonl(demo_reference / "metrics.jsonl")
    for stage, size, patches, context, mask in ((0, 21, 3, 8, ("random", 0.67)), (1, 28, 16, 16, ("none", 0.0))):
        (tokens, flops), = {(r["tokens_per_sample"], r["flops_per_sample"]) for r in rows if r["stage_index"] == stage}
        assert tokens == 1 + patches + context   # class token + the patches kept + text tokens
        model = create_clip("CRATE-alpha-CLIPA-tiny", pretrained=_export(demo_reference), image_size=size,
                            context_length=context).train()
        set_image_token_mask(model, *mask)
        assert model.visual.trunk.patch_size == 7
        images, text = torch.randn(2, 3, size, size), torch.randint(1, 1000, (2, context))
        with attention_kernel("auto", "cpu"), FlopCounterMode(display=False) as counter:   # as training on a CPU
            image_f, text_f, scale = model(image=images, text=text)[:3]
            logits, labels = scale * image_f @ text_f.t(), torch.arange(2)
            ((torch.nn.functional.cross_entropy(logits, labels)
              + torch.nn.functional.cross_entropy(logits.t(), labels)) / 2).backward()
        assert flops == counter.get_total_flops() / 2
        assert {r["tokens_per_s"] for r in rows if r["stage_index"] == stage} == {
            r["samples_per_s_window"] * tokens for r in rows if r["stage_index"] == stage}
