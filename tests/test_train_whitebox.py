"""White-box diagnostics during training under ZeRO-3 (partitioned weights): logged every N steps and at stage
ends into metrics.jsonl, equal to a recomputation from the exported final weights, drawn in the end-of-run plot;
the run's mid-run checkpoint (partitioned weights) exports with `crate-clip export`."""
import math

import pytest
import torch

from train_fixtures import read_jsonl, run_job, tiny_config, tiny_fmnist, torchrun_cmd, write_config  # noqa: F401

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]


@pytest.fixture(scope="module")
def zero3_run(tiny_fmnist, tmp_path_factory):
    """A 2-process ZeRO-3 run of two stages with diagnostics; (run folder, config file)."""
    root = tmp_path_factory.mktemp("zero3")
    run_dir = root / "run"
    stages = [{"name": "low", "image_size": 16, "context_length": 16, "samples": 96, "global_batch": 16,
               "lr": 2e-3, "warmup_steps": 1},
              {"name": "full", "image_size": 28, "context_length": 16, "samples": 64, "global_batch": 16,
               "lr": 2e-4, "warmup_steps": 1}]
    cfg = tiny_config(run_dir, tiny_fmnist, zero_stage=3, precision="fp32", stages=stages,
                      logging={"every_steps": 2, "diagnostics_every": 4, "diagnostics_images": 8})
    config_path = write_config(cfg, root / "run.yaml")
    proc = run_job(torchrun_cmd(2, "--config", str(config_path), module="crate_clip.train.cli"), timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return run_dir, config_path


def test_diagnostics_logged_under_zero3_match_the_final_weights(zero3_run):
    from crate_clip.models import create_clip
    from crate_clip.models.clip_factory import read_state_dict
    from crate_clip.train.run_config import load_run_config
    from crate_clip.train.whitebox_log import _probe_images
    from eval.whitebox import layer_diagnostics

    run_dir, config_path = zero3_run
    records = read_jsonl(run_dir / "metrics.jsonl")
    measured = [(r["stage_index"], r["step"]) for r in records if "whitebox" in r]
    assert measured == [(0, 4), (0, 6), (1, 4)]  # every 4 steps and each stage's last step
    last = [r for r in records if "whitebox" in r][-1]["whitebox"]
    assert len(last["coding_rate"]) == 4 and all(math.isfinite(v) for v in last["coding_rate"])
    assert all(0 < v < 1 for v in last["l0"]) and last["probe_images"] == 8

    # the gathered ZeRO-3 weights are the real ones: recompute from the exported final weights
    model = create_clip("CRATE-alpha-CLIPA-tiny", image_size=28, context_length=16,
                        pretrained=read_state_dict(run_dir / "export" / "open_clip_model.safetensors"))
    images = _probe_images(load_run_config(config_path), 28, model, 8)
    again = layer_diagnostics(model.eval(), images)
    assert again["coding_rate"] == pytest.approx(last["coding_rate"], rel=1e-4)
    assert again["zero_fraction"] == pytest.approx(last["zero_fraction"], abs=1e-6)
    assert (run_dir / "training_curve.png").stat().st_size > 0


def test_crate_clip_export_of_a_mid_run_zero3_checkpoint(zero3_run, tmp_path):
    """Stage 0's last checkpoint of the ZeRO-3 run (partitioned weights) exports at its 16 px and reloads
    through open_clip with exactly its consolidated weights."""
    from crate_clip.cli import main
    from crate_clip.train.checkpoints import consolidated_state_dict
    from crate_clip.train.export import export_state_equal, load_export

    run_dir, _ = zero3_run
    assert main(["export", str(run_dir), "--stage", "0", "--out", str(tmp_path / "s0")]) == 0
    model = load_export(tmp_path / "s0")[0]
    assert model.visual.image_size == (16, 16)
    assert export_state_equal(model, consolidated_state_dict(run_dir / "checkpoints" / "stage0-step00000006"))


def test_diagnostics_need_an_eval_set(tmp_path):
    from crate_clip.train.run_config import ConfigError, load_run_config

    cfg = tiny_config(tmp_path / "run", tmp_path, evals=False, logging={"diagnostics_every": 5})
    with pytest.raises(ConfigError, match="logging.diagnostics_every"):
        load_run_config(write_config(cfg, tmp_path / "run.yaml"))
