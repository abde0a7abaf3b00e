"""Linear probe / few-shot evaluation: the classifier against sklearn, the CLI on CLIP and timm models, the cache."""
import json

import numpy as np
import pytest
import torch

from crate_clip.cli import main as crate_clip_main
from crate_clip.data.sources.fashion_mnist import load_fashion_mnist
from crate_clip.eval.tasks import linear_probe
from eval_fixtures import PER_CLASS


def pixel_features(fashion_mnist_dir, split: str, n: int):
    """L2-normalised raw-pixel features of the first n images of a split (a real, not separable, problem)."""
    images, labels = load_fashion_mnist(split, fashion_mnist_dir)
    x = torch.from_numpy(images[:n].reshape(n, -1).astype(np.float32) / 255)
    return torch.nn.functional.normalize(x, dim=1), torch.from_numpy(labels[:n].astype(np.int64))


def test_probe_matches_sklearn_logistic_regression(fashion_mnist_dir):
    sklearn_linear = pytest.importorskip("sklearn.linear_model", reason="scikit-learn (dev extra) not installed")
    xtr, ytr = pixel_features(fashion_mnist_dir, "train", 1500)
    xte, yte = pixel_features(fashion_mnist_dir, "test", 1000)
    torch.manual_seed(0)
    ours = linear_probe.probe(xtr, ytr, xte, yte, 10, linear_probe.Settings(train_data="-", data="-"))
    assert ours["wd_trials"] >= 7 and ours["weight_decay"] in linear_probe.weight_decay_grid()
    reference = sklearn_linear.LogisticRegression(C=10.0, max_iter=2000).fit(xtr.numpy(), ytr.numpy())
    ref_top1 = float((reference.predict(xte.numpy()) == yte.numpy()).mean())
    assert ref_top1 > 0.7                                   # a real problem, far from chance (10%)
    assert abs(ours["top1"] - ref_top1) < 0.02, (ours, ref_top1)
    assert ours["top1"] <= ours["top5"] and 0.5 < ours["mean_per_class_recall"] <= 1


def test_fixed_weight_decay_and_metrics_by_hand():
    logits = torch.tensor([[3.0, 1, 0], [0, 2, 1], [2, 0, 1], [0, 1, 3]])
    labels = torch.tensor([0, 2, 1, 2])
    m = linear_probe.classification_metrics(logits, labels, 3)
    # top-1: rows 0 and 3 right; per-class recall: class 0 1/1, class 1 0/1, class 2 1/2
    assert m["top1"] == 0.5 and m["top5"] == 1.0 and m["mean_per_class_recall"] == pytest.approx(0.5)
    k = linear_probe.fewshot_indices(torch.tensor([0, 1, 0, 1, 0, 2]), 2, seed=0)
    assert sorted(torch.tensor([0, 1, 0, 1, 0, 2])[k].tolist()) == [0, 0, 1, 1, 2]


def test_cli_linear_probe_and_fewshot_on_a_clip_with_the_feature_cache(sets, vit_file, tmp_path, capsys):
    name, weights = vit_file
    base = ["eval", "linear-probe", "--model", name, "--pretrained", str(weights), "--train-data", str(sets["shards"]),
            "--data", str(sets["folder"]), "--dataset", "fashion_mnist", "--num-workers", "0",
            "--cache-dir", str(tmp_path / "cache"), "--batch-size", "64"]
    assert crate_clip_main(base + ["--output", str(tmp_path / "lp.json")]) == 0
    first = json.loads((tmp_path / "lp.json").read_text())
    out, err = capsys.readouterr()
    assert "linear probe: top-1" in out
    # stderr is no terminal here: plain lines (docs/cli.md#progress); shards have no total until read
    lines = [line.split(" in ")[0] for line in err.splitlines()]
    assert lines == ["[progress] train features: done, 3 batches", "[progress] test features: done, 3/3 batches",
                     f"[progress] linear probe fits: done, {first['wd_trials'] + 1} fits"], err
    assert first["n_test"] == 10 * PER_CLASS and first["features"] == "image" and first["cache_hit"] is False
    assert first["top1"] > 0.4 and first["n_train"] == 10 * PER_CLASS   # train+val after the search
    args = base + ["--fewshot-k", "4", "--fewshot-seeds", "2", "--output", str(tmp_path / "fs.json")]
    assert crate_clip_main(args) == 0
    few = json.loads((tmp_path / "fs.json").read_text())
    assert few["cache_hit"] is True and few["n_train"] == 40 and few["seeds"] == 2 and "top1_std" in few
    assert "4-shot probe (2 seeds)" in capsys.readouterr().out
    # tower features of the same model: another cache entry, another width (ViT width 64 == embed 64 here)
    assert crate_clip_main(base + ["--features", "tower", "--weight-decay", "1e-4",
                                   "--output", str(tmp_path / "tw.json")]) == 0
    tower = json.loads((tmp_path / "tw.json").read_text())
    assert tower["features"] == "tower" and tower["cache_hit"] is False and tower["weight_decay"] == 1e-4


def test_cli_linear_probe_on_a_timm_classifier_and_a_flat_folder(sets, tmp_path):
    import timm
    torch.manual_seed(0)
    model = timm.create_model("crate_alpha_tiny_patch16_224", img_size=32)
    weights = tmp_path / "crate.pth"
    torch.save(model.state_dict(), weights)
    assert crate_clip_main(["eval", "linear-probe", "--model", "timm:crate_alpha_tiny_patch16_224", "--pretrained",
                            str(weights), "--image-size", "32", "--train-data", str(sets["folder"]),
                            "--data", str(sets["flat"]), "--labels", str(sets["labels"]),
                            "--dataset", "fashion_mnist", "--num-workers", "0", "--no-progress", "--cache-dir", "",
                            "--weight-decay", "1e-4", "--output", str(tmp_path / "timm.json")]) == 0
    result = json.loads((tmp_path / "timm.json").read_text())
    # pooled tower features (width 192) of a random tower still separate some classes; chance is 10%
    assert result["features"] == "tower" and result["feature_dim"] == 192 and result["n_test"] == 10 * PER_CLASS
    assert result["top1"] > 0.3


def test_declared_after_a_stage_through_the_stage_hook(sets, tmp_path):
    from crate_clip.eval.stage_hook import evaluate_stage
    from eval_fixtures import shared_crate_tiny

    spec = {"name": "probe", "type": "linear_probe", "data": str(sets["folder"]), "train_data": str(sets["shards"]),
            "dataset": "fashion_mnist", "fewshot_k": 2, "batch_size": 80}
    result = evaluate_stage(shared_crate_tiny(), model_name="CRATE-alpha-CLIPA-tiny", evals=[spec], image_size=28,
                            cache_dir=str(tmp_path), progress=False)["probe"]
    assert result["fewshot_k"] == 2 and result["n_train"] == 20 and result["n_test"] == 10 * PER_CLASS
    assert 0 <= result["top1"] <= result["top5"] <= 1


def test_run_config_needs_the_training_split_of_a_probe():
    from crate_clip.train.run.run_config import ConfigError, config_from_dict
    raw = {"data": {"sources": ["x"]}, "stages": [dict(name="s", image_size=28, samples=512, global_batch=256)],
           "eval": {"evals": [{"name": "p", "type": "linear_probe", "data": "test"}]}}
    with pytest.raises(ConfigError, match="eval.evals.0.train_data: empty"):
        config_from_dict(raw, check_paths=False)
    raw["eval"]["evals"][0]["train_data"] = "train"
    assert config_from_dict(raw, check_paths=False).eval.evals[0].train_data.endswith("train")


def test_demo_prints_the_probe_of_its_export(sets, tmp_path, capsys):
    from crate_clip.train.demo import linear_probe_final
    from crate_clip.export.writer import export_open_clip
    from eval_fixtures import shared_crate_tiny

    run_dir = tmp_path / "run"
    export_open_clip(shared_crate_tiny().state_dict(), "CRATE-alpha-CLIPA-tiny", run_dir / "export", image_size=28,
                     context_length=32)
    metrics = linear_probe_final(run_dir, tmp_path / "data", sets["folder"], 60)
    assert metrics["n_test"] == 10 * PER_CLASS and metrics["n_train"] == 60 and (tmp_path / "data" / "probe_train_60").is_dir()
    assert "[demo] linear probe: top-1" in capsys.readouterr().out
    assert json.loads((run_dir / "linear_probe.json").read_text())["top1"] == metrics["top1"]
    assert linear_probe_final(run_dir, tmp_path / "data", sets["folder"], 0) is None
