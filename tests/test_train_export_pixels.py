"""Pixels in, pixels used (issue 39): a run whose fine-tune keeps the 3x3 grid at 27 px / patch 9 trains, evaluates
and exports the same input. The training stream's view of a test image, our evaluation's and open_clip's preprocess
of the export are the same tensor; open_clip, loading the export, gives our evaluation's features and scores the
top-1 the run recorded after its last stage."""
import random
import sys
from pathlib import Path

import pytest
import torch

import warm_python
from train_fixtures import read_jsonl, run_env, tiny_config, write_config

REPO_ROOT = Path(__file__).resolve().parents[1]
STAGES = [{"name": "low", "image_size": 21, "patch_size": 7, "context_length": 16, "samples": 32, "global_batch": 8,
           "lr": 2e-3, "warmup_steps": 1},
          {"name": "fine", "image_size": 27, "patch_size": 9, "context_length": 16, "samples": 16, "global_batch": 8,
           "lr": 2e-4}]


def _train(tmp_path: Path, data: Path) -> Path:
    """The two-stage run by the real trainer, one process, fp32: its run folder (checkpoints, results, export)."""
    cfg = tiny_config(tmp_path / "run", data, zero_stage=1, precision="fp32", stages=STAGES,
                      logging={"every_steps": 1, "progress": False, "tensorboard": False, "plot": False})
    cfg["eval"]["full_image_size"] = 27   # stage 0 also evaluated at the fine-tune's input
    cfg["data"]["num_workers"] = 0
    config = write_config(cfg, tmp_path / "run.yaml")
    proc = warm_python.run([sys.executable, "-m", "crate_clip.train.cli", "--config", str(config)], env=run_env(),
                           cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return tmp_path / "run"


@pytest.mark.slow
def test_open_clip_loading_the_export_sees_the_trained_pixels_and_scores_what_our_eval_scores(tiny_fmnist, tmp_path):
    import open_clip
    from PIL import Image

    from crate_clip.data.image_decode import decode_train, normalize_batch
    from crate_clip.eval.model_loading import load_eval_model
    from crate_clip.eval.registry import EvalContext, parse_eval, run_task

    run = _train(tmp_path, tiny_fmnist)
    rows = [(r["stage_name"], r["image_size"], r["resize"], r["patch_size"]) for r in read_jsonl(run / "results.jsonl")]
    assert rows == [("low", 21, "grid", 7), ("low", 27, "patch", 9), ("fine", 27, "grid", 9)]
    final = read_jsonl(run / "results.jsonl")[-1]

    spec = f"local-dir:{run / 'export'}"
    theirs, _, their_preprocess = open_clip.create_model_and_transforms(spec)
    theirs.eval()
    ours, our_preprocess, our_tokenizer, _ = load_eval_model(str(run / "checkpoints"))
    assert theirs.visual.preprocess_cfg["size"] == (27, 27) and theirs.visual.trunk.patch_size == 9

    # one 28 px test image, as the training stream crops it (the whole image at scale 1) and as both evaluations do
    image_file = sorted((tiny_fmnist / "test").rglob("*.png"))[0]
    mean, std = theirs.visual.preprocess_cfg["mean"], theirs.visual.preprocess_cfg["std"]
    trained = normalize_batch(decode_train(image_file.read_bytes(), 27, random.Random(0), scale=(1.0, 1.0))[None],
                              mean, std)[0]
    with Image.open(image_file) as img:
        assert img.size == (28, 28)
        pixels = {"open_clip": their_preprocess(img.convert("RGB")), "ours": our_preprocess(img.convert("RGB"))}
    for name, tensor in pixels.items():   # ToTensor + Normalize against the stream's fused form: rounding only
        torch.testing.assert_close(tensor, trained, rtol=0, atol=1e-5, msg=name)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # the trainer's evaluation ran one thread per process: the same kernels, the same bits
    try:
        with torch.no_grad():
            torch.testing.assert_close(theirs.encode_image(trained[None]), ours.encode_image(trained[None]),
                                       rtol=0, atol=1e-6)
        settings = parse_eval({"name": "fmnist", "type": "zeroshot", "dataset": "fashion_mnist",
                               "data": str(tiny_fmnist / "test"), "templates": "simple", "batch_size": 100})
        scored = {name: run_task(model, settings, EvalContext(tokenizer=tok, preprocess=pre, device="cpu",
                                                              precision="fp32", cache_dir=None, progress=False))
                  for name, model, pre, tok in (("open_clip", theirs, their_preprocess, open_clip.get_tokenizer(spec)),
                                                ("ours", ours, our_preprocess, our_tokenizer))}
    finally:
        torch.set_num_threads(threads)
    assert scored["open_clip"]["n_images"] == scored["ours"]["n_images"] == final["n_images"] > 0
    assert scored["open_clip"]["top1"] == scored["ours"]["top1"] == final["top1"]
    assert scored["open_clip"]["per_class"] == scored["ours"]["per_class"]
