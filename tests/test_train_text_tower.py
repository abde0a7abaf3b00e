"""A both-CRATE CLIP (CRATE-alpha image and text towers) trained like the image side alone: a two-stage 2-process
ZeRO-3 run with text token reduction, a context-length change, exact accumulation and gradient checkpointing
(train_fixtures.both_crate_config) evaluates after each stage, logs the white-box diagnostics of both towers,
resumes bit for bit after SIGKILL, and its export loads in a fresh interpreter with only `import crate_clip`."""
import json
import subprocess
import sys

import pytest
import torch

from test_train_resume import _export, _kill_at, _losses
from train_fixtures import (REPO_ROOT, TINY_EVAL_IMAGES, both_crate_config, ranks_cmd, read_jsonl, run_env, run_job,
                            write_config)

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

KILL_AT_STEP = 3   # of stage 0's 6: after its step-2 checkpoint


def _train_cmd(config, *extra):
    return ranks_cmd(2, "--config", str(config), *extra, module="crate_clip.train.cli")


def test_both_crate_run_evaluates_each_stage_and_logs_both_towers(both_crate_run):
    from crate_clip.train.checkpointing.checkpoints import consolidated_state_dict

    run_dir, _, _ = both_crate_run
    results = read_jsonl(run_dir / "results.jsonl")
    assert {(r["stage_index"], r["image_size"], r["context_length"]) for r in results} == {
        (0, 16, 8), (0, 28, 8), (1, 28, 16)}
    assert all(r["n_images"] == TINY_EVAL_IMAGES and 0 <= r["top1"] <= r["top5"] <= 1 for r in results)
    rows = read_jsonl(run_dir / "metrics.jsonl")
    # tokens the model that trains sees: class token + patches, and the stage's text length
    assert {(r["stage_index"], r["tokens_per_sample"]) for r in rows} == {(0, 17 + 8), (1, 50 + 16)}
    # both towers' diagnostics (checked against the export in test_train_whitebox.py)
    assert all(("whitebox" in r) == ("whitebox_text" in r) for r in rows) and any("whitebox_text" in r for r in rows)
    # the text position embedding follows the context length from stage to stage
    ckpts = run_dir / "checkpoints"
    assert consolidated_state_dict(ckpts / "stage0-step00000006")["text.positional_embedding"].shape == (8, 64)
    assert consolidated_state_dict(ckpts / "stage1-step00000003")["text.positional_embedding"].shape == (16, 64)
    assert list((run_dir / "tensorboard").glob("events.*")) and (run_dir / "training_curve.png").is_file()


def test_sigkill_mid_stage_then_resume_is_bit_exact(both_crate_run, tmp_path):
    ref_dir, _, data = both_crate_run
    run_dir = tmp_path / "run"
    config = write_config(both_crate_config(run_dir, data), tmp_path / "run.yaml")
    _kill_at(_train_cmd(config), run_dir, 0, KILL_AT_STEP)
    latest = (run_dir / "checkpoints" / "latest").read_text()
    assert latest.startswith("stage0-") and latest != "stage0-step00000006", latest
    resumed = run_job(_train_cmd(config, "--resume", "latest"), timeout=400)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-6000:]
    assert _losses(run_dir) == _losses(ref_dir) and len(_losses(run_dir)) == 6 + 3
    ref, got = _export(ref_dir), _export(run_dir)
    assert set(ref) == set(got) and all(torch.equal(got[k], ref[k]) for k in ref)


FRESH_INTERPRETER = r"""
import json, sys
import crate_clip, open_clip, torch
from safetensors.torch import load_file
folder = sys.argv[1]
model, _, preprocess = open_clip.create_model_and_transforms(f"local-dir:{folder}")
tokenizer = open_clip.get_tokenizer(f"local-dir:{folder}")
saved = load_file(f"{folder}/open_clip_model.safetensors")
own = model.state_dict()
with torch.no_grad():
    text = model.encode_text(tokenizer(["a photo of a sandal."]), normalize=True)
print("RESULT", json.dumps({"tower": type(model.text).__name__, "context": tokenizer.context_length,
      "equal": set(own) == set(saved) and all(torch.equal(own[k].float().reshape(-1), v.reshape(-1))
                                              for k, v in saved.items()), "text": text[0].tolist()}))
"""


def test_export_loads_in_a_fresh_interpreter_with_only_import_crate_clip(both_crate_run):
    from crate_clip.export.writer import load_export

    run_dir, _, _ = both_crate_run
    proc = subprocess.run([sys.executable, "-c", FRESH_INTERPRETER, str(run_dir / "export")], env=run_env(),
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.split("RESULT", 1)[1])
    assert got["tower"] == "CrateAlphaText" and got["context"] == 16 and got["equal"]
    model, _, tokenizer = load_export(run_dir / "export")
    with torch.no_grad():
        want = model.encode_text(tokenizer(["a photo of a sandal."]), normalize=True)[0]
    # another process may run other thread counts: float32 sums in another order
    torch.testing.assert_close(torch.tensor(got["text"]), want, rtol=1e-5, atol=1e-6)
