"""White-box diagnostics during training under ZeRO-3 (partitioned weights), of both CRATE-alpha towers of the tiny
both-CRATE CLIP: logged every N steps and at stage ends into metrics.jsonl, equal to a recomputation from the exported
final weights, drawn in the end-of-run plot; the run's mid-run checkpoint (partitioned weights) exports with
`crate-clip export`."""
import math

import pytest

from train_fixtures import BOTH_CRATE, read_jsonl, tiny_config, write_config

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]


def test_diagnostics_logged_under_zero3_match_the_final_weights(both_crate_run):
    from crate_clip.models import create_clip
    from crate_clip.models.clip_factory import read_state_dict
    from crate_clip.train.run.run_config import load_run_config
    from crate_clip.train.reporting.whitebox_log import _probe_images, _probe_tokens
    from crate_clip.eval.whitebox import layer_diagnostics
    from crate_clip.eval.whitebox_text import text_layer_diagnostics

    run_dir, config_path, _ = both_crate_run
    records = read_jsonl(run_dir / "metrics.jsonl")
    measured = [(r["stage_index"], r["step"]) for r in records if "whitebox" in r]
    assert measured == [(0, 2), (0, 4), (0, 6), (1, 2), (1, 3)]  # every 2 steps and each stage's last step
    assert measured == [(r["stage_index"], r["step"]) for r in records if "whitebox_text" in r]
    last = [r for r in records if "whitebox" in r][-1]
    image, text = last["whitebox"], last["whitebox_text"]
    assert len(image["coding_rate"]) == 4 and all(math.isfinite(v) for v in image["coding_rate"])
    assert all(0 < v < 1 for v in image["l0"]) and image["probe_images"] == 8
    assert len(text["coding_rate"]) == 2 and all(0 < v < 1 for v in text["l0"]) and text["probe_captions"] == 8

    # the gathered ZeRO-3 weights are the real ones: recompute both towers' numbers from the exported final weights
    model = create_clip(BOTH_CRATE, image_size=28, context_length=16,
                        pretrained=read_state_dict(run_dir / "export" / "open_clip_model.safetensors")).eval()
    cfg = load_run_config(config_path)
    for key, again in (("whitebox", layer_diagnostics(model, _probe_images(cfg, 28, model, 8))),
                       ("whitebox_text", text_layer_diagnostics(model, _probe_tokens(cfg, model, 8)))):
        assert again["coding_rate"] == pytest.approx(last[key]["coding_rate"], rel=1e-4), key
        assert again["zero_fraction"] == pytest.approx(last[key]["zero_fraction"], abs=1e-6), key
    assert (run_dir / "training_curve.png").stat().st_size > 0


def test_crate_clip_export_of_a_mid_run_zero3_checkpoint(both_crate_run, tmp_path):
    """Stage 0's last checkpoint of the ZeRO-3 run (partitioned weights) exports at its 16 px and reloads
    through open_clip with exactly its consolidated weights."""
    from crate_clip.cli import main
    from crate_clip.train.checkpointing.checkpoints import consolidated_state_dict
    from crate_clip.export.writer import export_state_equal, load_export

    run_dir, _, _ = both_crate_run
    assert main(["export", str(run_dir), "--stage", "0", "--out", str(tmp_path / "s0")]) == 0
    model = load_export(tmp_path / "s0")[0]
    assert model.visual.image_size == (16, 16) and model.context_length == 8   # stage 0's text length
    assert export_state_equal(model, consolidated_state_dict(run_dir / "checkpoints" / "stage0-step00000006"))


def test_diagnostics_need_an_eval_set(tmp_path):
    from crate_clip.train.run.run_config import ConfigError, load_run_config

    cfg = tiny_config(tmp_path / "run", tmp_path, evals=False, logging={"diagnostics_every": 5})
    with pytest.raises(ConfigError, match="logging.diagnostics_every"):
        load_run_config(write_config(cfg, tmp_path / "run.yaml"))
