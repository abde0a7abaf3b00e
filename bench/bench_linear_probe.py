"""Linear probe of the demo model: full and 10-shot (several seeds, mean ± std) on Fashion-MNIST
image features, a random-init tower of the same shape as the floor, and scikit-learn's LogisticRegression on
the same cached features as a cross-check of the probe's classifier.

    .venv/bin/python bench/bench_linear_probe.py [--export runs/fashion_mnist_demo/export]
        [--train-data data/fashion_mnist/probe_train_10000] [--test-data data/fashion_mnist/test]

The training folder is the one `make demo` writes for its final probe (the first 10,000 training images);
`--train-images N` writes and uses the first N instead (60000: the whole split).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from report import markdown_table  # noqa: E402  (bench/ on the path, as the other benches)

SEEDS = 5   # few-shot draws: seeds 0..4
DEMO_MODEL = "CRATE-alpha-CLIPA-tiny"


def features(model, preprocess, settings, cache_dir: Path):
    """(train features, labels, test features, labels) through the probe's own cached extraction."""
    from crate_clip.eval.tasks import linear_probe
    from crate_clip.eval.eval_datasets import classification_dataset

    out = []
    for data, limit in ((settings.train_data, None), (settings.data, settings.max_images)):
        dataset = classification_dataset(data, preprocess, dataset=settings.dataset, num_classes=10)
        feats, labels, _ = linear_probe.cached_features(
            model, dataset, data, preprocess, cache_dir=cache_dir, kind="image", normalize=True, precision="fp32",
            max_images=limit, labels=None, batch_size=settings.batch_size, device="cpu", num_workers=0,
            progress=False)
        out += [feats, labels]
    return out


def sklearn_top1(xtr, ytr, xte, yte, settings) -> tuple[float, float]:
    """scikit-learn LogisticRegression (lbfgs), C chosen on the probe's own held-out split, refit on all:
    (top-1, chosen C)."""
    from sklearn.linear_model import LogisticRegression

    from crate_clip.eval.tasks import linear_probe
    tr, va = linear_probe.split_train_val(ytr, settings.val_proportion, settings.seed)
    best = None
    for c in (0.1, 1.0, 10.0, 100.0, 1000.0):
        clf = LogisticRegression(C=c, max_iter=3000).fit(xtr[tr].numpy(), ytr[tr].numpy())
        acc = float((clf.predict(xtr[va].numpy()) == ytr[va].numpy()).mean())
        best = max(best or (acc, c), (acc, c))
    c = best[1]
    clf = LogisticRegression(C=c, max_iter=3000).fit(xtr.numpy(), ytr.numpy())
    return float((clf.predict(xte.numpy()) == yte.numpy()).mean()), c


def evaluate(label: str, model, preprocess, settings, cache_dir: Path, with_sklearn: bool) -> dict:
    """Full probe, 10-shot over SEEDS, optionally the sklearn cross-check, on one model's features."""
    from crate_clip.eval.tasks import linear_probe

    t0 = time.perf_counter()
    torch.manual_seed(0)
    xtr, ytr, xte, yte = features(model, preprocess, settings, cache_dir)
    full = linear_probe.probe(xtr, ytr, xte, yte, 10, settings)
    few = linear_probe.fewshot_probe(xtr, ytr, xte, yte, 10, settings.model_copy(update={"fewshot_k": 10,
                                                                                         "fewshot_seeds": SEEDS}))
    row = {"model": label, "n_train": len(ytr), "n_test": len(yte), "full_top1": full["top1"],
           "full_top5": full["top5"], "full_wd": full["weight_decay"], "fewshot10_top1": few["top1"],
           "fewshot10_top1_std": few["top1_std"], "seconds": 0.0}
    if with_sklearn:
        row["sklearn_top1"], row["sklearn_C"] = sklearn_top1(xtr, ytr, xte, yte, settings)
    row["seconds"] = time.perf_counter() - t0
    print(json.dumps(row), flush=True)
    return row


def markdown(rows: list[dict]) -> str:
    """The BENCHMARKS.md table."""
    header = ["image features", "train / test images", "linear probe top-1 (wd)", "10-shot top-1, 5 seeds",
              "sklearn LogisticRegression top-1 (C)"]
    cells = [[r["model"], f"{r['n_train']:,} / {r['n_test']:,}", f"{100 * r['full_top1']:.2f}% ({r['full_wd']:.2g})",
              f"{100 * r['fewshot10_top1']:.2f} ± {100 * r['fewshot10_top1_std']:.2f}%",
              f"{100 * r['sklearn_top1']:.2f}% (C={r['sklearn_C']:g})" if "sklearn_top1" in r else "-"]
             for r in rows]
    return markdown_table(header, cells)


def main() -> int:
    """Probe the demo export and a random-init tower; print the table."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--export", default=str(ROOT / "runs" / "fashion_mnist_demo" / "export"))
    p.add_argument("--train-data", default=None, help="labelled training folder (default: the demo's probe folder)")
    p.add_argument("--train-images", type=int, default=10_000, help="first N training images (default 10000)")
    p.add_argument("--data-dir", default=str(ROOT / "data" / "fashion_mnist"))
    p.add_argument("--test-data", default=None, help="test folder (default: DATA_DIR/test)")
    p.add_argument("--max-test-images", type=int, default=None, help="spread over the test split (a smoke run)")
    p.add_argument("--no-sklearn", action="store_true")
    args = p.parse_args()

    import crate_clip  # noqa: F401  (registers the towers)
    from crate_clip.models import create_clip
    from crate_clip.data.sources.fashion_mnist import write_fashion_mnist_eval_folder
    from crate_clip.eval.tasks import linear_probe
    from crate_clip.eval.model_loading import load_eval_model

    data_dir = Path(args.data_dir)
    train = Path(args.train_data) if args.train_data else data_dir / f"probe_train_{args.train_images}"
    if not (train / "classnames.txt").is_file():
        write_fashion_mnist_eval_folder(train, split="train", limit=args.train_images)
    test = Path(args.test_data) if args.test_data else data_dir / "test"
    torch.set_num_threads(2)
    export = Path(args.export)
    cfg = json.loads((export / "open_clip_config.json").read_text())["model_cfg"]
    size = cfg["vision_cfg"]["image_size"]
    model, preprocess, _, _ = load_eval_model(f"local-dir:{export}", image_size=size)
    settings = linear_probe.Settings(train_data=str(train), data=str(test), dataset="fashion_mnist", batch_size=500,
                                      max_images=args.max_test_images)
    cache = export.parent / "eval_cache"
    rows = [evaluate(f"demo model ({export})", model, preprocess, settings, cache, not args.no_sklearn)]
    torch.manual_seed(0)
    run_config = export.parent / "run_config.yaml"
    model_name = yaml.safe_load(run_config.read_text())["model"]["name"] if run_config.is_file() else DEMO_MODEL
    random_model = create_clip(model_name, image_size=size, context_length=cfg["text_cfg"]["context_length"],
                               patch_size=cfg["vision_cfg"].get("patch_size")).eval()
    rows.append(evaluate("random-init tower (same shape)", random_model, preprocess, settings, cache,
                         not args.no_sklearn))
    print("\n" + markdown(rows))
    (export.parent / "linear_probe_bench.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
