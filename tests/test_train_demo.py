"""`python -m crate_clip.train.demo`: its plumbing end to end (data, torchrun launch, evaluation after each
stage, summary, export) on a few images, not its accuracy."""
import json

import pytest

from crate_clip.train.reporting.metrics_log import RESULTS_FILE, read_jsonl

TINY_RUN = ["stages.0.samples=128", "stages.0.global_batch=64", "stages.0.warmup_steps=0",
            "stages.1.samples=64", "stages.1.global_batch=64", "stages.1.warmup_steps=0", "data.num_workers=0",
            "data.shuffle_buffer=64", "checkpoint.every_steps=0", "eval.evals.0.batch_size=40",
            "logging.progress=false", "logging.tensorboard=false"]


def _warm_launcher(monkeypatch, request) -> None:
    """The demo's torchrun launcher forked warm (with the test's `request`, torchrun's workers too, as stand-ins)."""
    from crate_clip.train import demo
    from train_fixtures import warm_subprocess

    warm_subprocess(monkeypatch, demo, request)


@pytest.mark.slow
@pytest.mark.multiproc
def test_demo_runs_end_to_end_on_a_few_images(fashion_mnist_dir, tmp_path, capfd, monkeypatch, request):
    from crate_clip.train.demo import main

    _warm_launcher(monkeypatch, request)

    run = tmp_path / "run"
    argv = ["--data-dir", str(tmp_path / "data"), "--run-dir", str(run), "--nproc", "2",
            "--max-train-images", "192", "--max-test-images", "40", "--probe-train-images", "60"]
    assert main(argv + [arg for o in TINY_RUN for arg in ("--set", o)] + ["--json"]) == 0
    results = read_jsonl(run / RESULTS_FILE)
    # stage 0 at 21 px / patch 7, then evaluated at the fine-tune's input, 27 px, by patch resize (p9, 3x3; grid
    # growth at p7 would drop pixels of 27 px: not evaluated); stage 1 at 27 px / patch 9
    assert [(r["stage_name"], r["image_size"], r["resize"], r["patch_size"], r["n_images"]) for r in results] == [
        ("lowres", 21, "grid", 7, 40), ("lowres", 27, "patch", 9, 40), ("fullres", 27, "grid", 9, 40)]
    printed, out = capfd.readouterr()   # the trainer's processes write to the file descriptors
    # --json: stdout holds the result alone; the demo's lines and the trainer's went to stderr
    record = json.loads(printed)
    assert record["exit_code"] == 0 and record["results"] == results and record["linear_probe"]["n_train"] == 60
    assert record["training_flops"] > 0 and record["export"] == str(run / "export") and len(record["claims"]) == 2
    assert "zero-shot top-1 on the 40 Fashion-MNIST test images" in out and "stage 1 fullres" in out
    assert "(grid kept, kernel PI-resized)" in out and "TFLOP of training (step meter, 192 samples)" in out
    # a smoke run is not the recorded recipe: the comparison at equal FLOPs is not printed as its own
    assert "(demo_recipe.json) is not claimed for this run: stage 0 samples 128, the record's 245760" in out
    assert "full-resolution training (" not in out
    vision_cfg = json.loads((run / "export" / "open_clip_config.json").read_text())["model_cfg"]["vision_cfg"]
    assert (vision_cfg["image_size"], vision_cfg["patch_size"]) == (27, 9)
    assert (run / "training_curve.png").is_file()
    # no misleading random-init notice (weights are loaded or random by design), and no
    # torch deprecation notices of the collectives DeepSpeed and open_clip's ClipLoss call (one per rank)
    assert "initialized randomly" not in out and "is deprecated" not in out
    assert "final model on the 40 test images" in out
    _timm_scores_what_eval_scored(run / "export", tmp_path / "data" / "test", results[-1])


def _timm_scores_what_eval_scored(export, test_dir, final: dict) -> None:
    """timm loads the export's image tower as docs/export.md shows (an overlay `file`, and `checkpoint_path=`) with
    the export's own preprocessing: its transform gives open_clip's tensors, its tower the CLIP's features, and
    through the CLIP's projection and text classifier the demo's final zero-shot top-1 on the same images."""
    import timm
    import torch
    import torch.nn.functional as F
    from PIL import Image
    from timm.data import create_transform, resolve_data_config

    from crate_clip.core.class_names import FASHION_MNIST_CLASSNAMES, FASHION_MNIST_TEMPLATES
    from crate_clip.eval.tasks.zeroshot import build_text_classifier
    from crate_clip.export.writer import load_export

    config = json.loads((export / "open_clip_config.json").read_text())
    name, pre = config["model_cfg"]["vision_cfg"]["timm_model_name"], config["preprocess_cfg"]
    weights = str(export / "open_clip_model.safetensors")
    tower = timm.create_model(name, pretrained=True, pretrained_cfg_overlay=dict(file=weights)).eval()
    data_cfg = resolve_data_config({}, model=tower)
    assert data_cfg == {"input_size": (3, 27, 27), "interpolation": pre["interpolation"], "mean": tuple(pre["mean"]),
                        "std": tuple(pre["std"]), "crop_pct": 1.0, "crop_mode": "center"}
    by_path = timm.create_model(name, checkpoint_path=weights).eval()   # the file's tensors alone: no crop either
    assert {k: resolve_data_config({}, model=by_path)[k] for k in ("input_size", "crop_pct")} == {
        "input_size": (3, 27, 27), "crop_pct": 1.0}
    model, preprocess, tokenizer = load_export(export)
    paths = sorted(test_dir.glob("*/*.png"))
    labels = torch.tensor([int(p.parent.name.split("_")[0]) for p in paths])
    images = [Image.open(p).convert("RGB") for p in paths]   # as timm's ImageDataset reads them
    x = torch.stack([create_transform(**data_cfg)(image) for image in images])
    assert len(paths) == final["n_images"] == 40 and torch.equal(x, torch.stack([preprocess(i) for i in images]))
    with torch.no_grad():
        features = tower(x)
        torch.testing.assert_close(features, model.visual.trunk(x))
        torch.testing.assert_close(by_path(x), features)
        classifier = build_text_classifier(model, tokenizer, FASHION_MNIST_CLASSNAMES, FASHION_MNIST_TEMPLATES,
                                           progress=False)
        top1 = (F.normalize(model.visual.head(features), dim=-1) @ classifier).argmax(dim=1)
    # the demo scored on 2 ranks, other batch shapes: an arg-max between equal logits may go either way
    assert abs(int((top1 == labels).sum()) - round(final["top1"] * 40)) <= 1, (top1, labels, final["top1"])


@pytest.mark.multiproc
def test_a_failed_demo_says_so_and_prints_no_results(fashion_mnist_dir, tmp_path, capfd, monkeypatch, request):
    from crate_clip.train.demo import main

    _warm_launcher(monkeypatch, request)

    run = tmp_path / "run"
    missing = tmp_path / "missing.pt"   # a file only the trainer reads: the demo's own config check passes
    argv = ["--data-dir", str(tmp_path / "data"), "--run-dir", str(run), "--nproc", "1",
            "--max-train-images", "64", "--max-test-images", "10", "--set", f"model.pretrained={missing}"]
    rc = main(argv)   # the worker's own exit code (2: the run config), not torchrun's 1
    out, err = capfd.readouterr()
    assert rc == 2 and "model.pretrained: file" in err and f"training stopped with exit code {rc}" in err
    assert "ChildFailedError" not in err
    assert "zero-shot top-1 on the" not in out and "[demo] plot:" not in out


def test_a_demo_whose_patches_do_not_tile_a_stage_is_refused_before_anything_is_written(tmp_path, capfd):
    """Issue 39: `--set stages.1.image_size=28` at the demo's 9 px patches would drop a pixel row and column; the
    demo reads its config with the overrides first: exit 2, the one line of the run config's check, no data."""
    from crate_clip.train.demo import main

    rc = main(["--data-dir", str(tmp_path / "data"), "--run-dir", str(tmp_path / "run"),
               "--set", "stages.1.image_size=28"])
    err = capfd.readouterr().err
    assert rc == 2 and not (tmp_path / "data").exists() and not (tmp_path / "run").exists()
    assert ("stages.1: image_size 28 is not a multiple of patch_size 9 (the patch convolution would drop 1 pixel "
            "row and column); use 27 or 36") in err


def test_demo_paths_come_from_its_config_and_the_makefile_installs_the_listed_packages():
    import subprocess
    import sys
    from pathlib import Path

    from crate_clip.train.demo import DEMO_CONFIG, demo_paths
    from crate_clip.train.run.run_config import load_run_config
    from crate_clip.data.sources.debian_packages import DEBIAN_PACKAGES

    cfg = load_run_config(DEMO_CONFIG, check_paths=False)
    assert demo_paths(str(DEMO_CONFIG), None, None) == (
        Path(cfg.data.sources[0]).resolve(), Path(cfg.eval.evals[0].data).resolve(), Path(cfg.run.output_dir).resolve())
    assert demo_paths(str(DEMO_CONFIG), "/d", "/r") == (Path("/d/train"), Path("/d/test"), Path("/r"))
    # the Makefile's DEB_DATA is what the Python list prints (run as a plain script, before any install)
    root = Path(DEMO_CONFIG).parents[2]
    printed = subprocess.run([sys.executable, "data_pipelines/sources/debian_packages.py"], cwd=root,
                             capture_output=True, text=True, check=True).stdout.split()
    assert printed == list(DEBIAN_PACKAGES.values())
    assert "DEB_DATA := $(shell $(PYTHON) data_pipelines/sources/debian_packages.py)" in (root / "Makefile").read_text()


def test_the_summary_lists_each_stage_end_not_the_mid_stage_evaluations(tmp_path, capsys):
    from crate_clip.train.demo import summarize

    row = dict(n_images=10, stage_index=0, stage_name="low", stage_image_size=21, image_size=21, patch_size=7)
    rows = [dict(row, top1=0.5, at="mid_stage"), dict(row, top1=0.6), dict(row, top1=None)]
    (tmp_path / RESULTS_FILE).write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert summarize(tmp_path) == rows   # every row returned (the demo's --json record)
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("  stage")]
    assert printed == ["  stage 0 low      trained at  21 px, evaluated at  21 px / patch 7:  60.00%"]
