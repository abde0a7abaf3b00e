"""Evaluation speed on CPU: zero-shot images/s at 224 px and text-classifier build time, cached and not.

    .venv/bin/python bench/bench_eval.py [--images 32] [--rounds 2] [--classes 1000] [--baseline-classes 100]

Baselines measured in the same run: (1) the bare image-tower forward on pre-decoded tensors, for the
images/s of the whole pipeline (JPEG decode + transform + forward + scoring); (2) open_clip's
build_zero_shot_classifier on the same model, classes and 80 templates, for the classifier build.
Writes its table to BENCHMARKS.md (section `eval`).
"""
import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import open_clip
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import crate_clip  # noqa: E402,F401  (registers the CRATE-alpha configs)
from bench.report import machine_line, write_section  # noqa: E402
from crate_clip.eval.class_sets import FASHION_MNIST_CLASSNAMES, FASHION_MNIST_TEMPLATES  # noqa: E402
from crate_clip.eval.eval_datasets import classification_dataset  # noqa: E402
from crate_clip.eval.model_loading import eval_transform  # noqa: E402
from crate_clip.models import create_clip  # noqa: E402
from crate_clip.eval.tasks.zeroshot import build_text_classifier, cached_text_classifier, zero_shot_evaluate  # noqa: E402

IMAGE_MODEL = "CRATE-alpha-CLIP-B-16"      # the real-size B/16 tower, at 224 px (CLIP-BPE text: no hub)
TEXT_MODEL = "CRATE-alpha-CLIPA-tiny"      # a CPU cannot push 80,000 prompts through a B/16 text tower quickly
FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")


def write_224px_folder(root: Path, n: int) -> Path:
    """n Fashion-MNIST test images upscaled to 256 px JPEGs in an ImageFolder (class-dir order = label order)."""
    import gzip
    with gzip.open(FASHION_MNIST / "t10k-images-idx3-ubyte.gz") as f:
        images = np.frombuffer(f.read(), np.uint8, offset=16).reshape(-1, 28, 28)
    with gzip.open(FASHION_MNIST / "t10k-labels-idx1-ubyte.gz") as f:
        labels = np.frombuffer(f.read(), np.uint8, offset=8)
    for i in range(n):
        folder = root / f"class_{labels[i]:02d}"
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(images[i]).resize((256, 256), Image.BICUBIC).convert("RGB").save(folder / f"{i}.jpg", quality=90)
    for c in range(10):   # every class folder present, so the folder matches the 10 class names
        (root / f"class_{c:02d}").mkdir(exist_ok=True)
    return root


def bench_images(n_images: int, batch_size: int, workers: int, rounds: int) -> list[tuple[str, float]]:
    """Images/s (best of `rounds`, interleaved): bare tower forward on tensors vs the full zero-shot pipeline."""
    model = create_clip(IMAGE_MODEL).eval()
    preprocess = eval_transform(model)
    tokenizer = open_clip.get_tokenizer(IMAGE_MODEL)
    best = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_224px_folder(Path(tmp), n_images)
        dataset = classification_dataset(folder, preprocess, dataset="fashion_mnist", num_classes=10)
        tensors = torch.stack([dataset[i][0] for i in range(len(dataset))])
        with torch.no_grad():
            model(image=tensors[:2])   # warm-up
        for _ in range(rounds):   # interleaved so a noisy neighbour hurts every path alike
            best["tower forward only, pre-decoded tensors (baseline)"] = max(
                best.get("tower forward only, pre-decoded tensors (baseline)", 0.0), _bare_rate(model, tensors, batch_size))
            for precision in ("fp32", "bf16"):
                result = zero_shot_evaluate(model, tokenizer, dataset, FASHION_MNIST_CLASSNAMES,
                                            FASHION_MNIST_TEMPLATES, batch_size=batch_size, num_workers=workers,
                                            precision=precision, progress=False)
                name = f"zero_shot_evaluate {precision}: JPEG decode + transform + forward + top-k"
                best[name] = max(best.get(name, 0.0), result["images_per_second"])
    return list(best.items())


@torch.no_grad()
def _bare_rate(model, tensors: torch.Tensor, batch_size: int) -> float:
    start = time.perf_counter()
    for i in range(0, len(tensors), batch_size):
        model(image=tensors[i:i + batch_size])
    return len(tensors) / (time.perf_counter() - start)


def bench_classifier(classes: int, baseline_classes: int) -> list[tuple[str, float, float | None]]:
    """Seconds to build the classes x 80 classifier: ours uncached and cached, and open_clip's builder."""
    model = create_clip(TEXT_MODEL).eval()
    tokenizer = open_clip.get_tokenizer(TEXT_MODEL)
    templates = list(open_clip.OPENAI_IMAGENET_TEMPLATES)
    rows = []
    names = list(open_clip.IMAGENET_CLASSNAMES[:baseline_classes])
    start = time.perf_counter()
    with torch.no_grad():
        open_clip.build_zero_shot_classifier(model, tokenizer, names, templates, num_classes_per_batch=10)
    baseline = time.perf_counter() - start
    rows.append((f"open_clip build_zero_shot_classifier, {len(names)} x 80 (baseline)", baseline, 1.0))
    start = time.perf_counter()
    build_text_classifier(model, tokenizer, names, templates, progress=False)
    ours = time.perf_counter() - start
    rows.append((f"build_text_classifier, {len(names)} x 80", ours, baseline / ours))
    names = list(open_clip.IMAGENET_CLASSNAMES[:classes])
    with tempfile.TemporaryDirectory() as cache:
        _, first = cached_text_classifier(model, tokenizer, names, templates, cache_dir=cache, progress=True)
        _, second = cached_text_classifier(model, tokenizer, names, templates, cache_dir=cache, progress=False)
    assert not first["cache_hit"] and second["cache_hit"]
    rows.append((f"cached_text_classifier, {len(names)} x 80, first (builds + saves)", first["classifier_seconds"], None))
    rows.append((f"cached_text_classifier, {len(names)} x 80, second (cache hit, incl. weight hashing)",
                 second["classifier_seconds"], first["classifier_seconds"] / second["classifier_seconds"]))
    return rows


def _text_tower(model_name: str) -> tuple[str, int]:
    """(description, width^2 x layers x tokens: proportional to the text tower's FLOPs per prompt)."""
    cfg = open_clip.get_model_config(model_name)["text_cfg"]
    text = f"width {cfg['width']}, {cfg['layers']} layers, {cfg['context_length']} tokens"
    return text, cfg["width"] ** 2 * cfg["layers"] * cfg["context_length"]


def main(argv=None) -> int:
    """Run both benchmarks and write the `eval` section of BENCHMARKS.md."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2, help="image-throughput rounds (best of)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--classes", type=int, default=1000)
    parser.add_argument("--baseline-classes", type=int, default=100)
    args = parser.parse_args(argv)
    load_before = os.getloadavg()[0]
    image_rows = bench_images(args.images, args.batch_size, args.workers, args.rounds)
    classifier_rows = bench_classifier(args.classes, args.baseline_classes)
    base = image_rows[0][1]
    load_note = (f"1-min load average {load_before:.1f} at the start, {os.getloadavg()[0]:.1f} at the end on "
                 f"{os.cpu_count()} cores (above the core count, other jobs shared the CPU and the images/s ratios are "
                 f"not reliable: re-run on an idle machine).")
    lines = ["## Evaluation (`bench/bench_eval.py`)", "", f"`python bench/bench_eval.py --images {args.images} --rounds {args.rounds} --classes {args.classes} "
             f"--baseline-classes {args.baseline_classes}`", "", machine_line(), "",
             f"Zero-shot throughput, {IMAGE_MODEL} (random weights) at 224 px, {args.images} JPEGs, batch "
             f"{args.batch_size}, {args.workers} loader worker(s), best of {args.rounds} interleaved rounds:", "",
             "| path | images/s | vs baseline |", "| --- | ---: | ---: |"]
    lines += [f"| {name} | {rate:.2f} | {rate / base:.2f}x |" for name, rate in image_rows]
    lines += ["", load_note]
    lines += ["", f"Text classifier (80 OpenAI templates) through the text tower of {TEXT_MODEL} "
              f"({_text_tower(TEXT_MODEL)[0]}); {IMAGE_MODEL}'s ({_text_tower(IMAGE_MODEL)[0]}) needs "
              f"~{_text_tower(IMAGE_MODEL)[1] / _text_tower(TEXT_MODEL)[1]:.0f}x its FLOPs per prompt:", "", "| build | seconds | speed-up |", "| --- | ---: | ---: |"]
    lines += [f"| {name} | {sec:.2f} | {'' if ratio is None else f'{ratio:.1f}x'} |"
              for name, sec, ratio in classifier_rows]
    table = "\n".join(lines)
    print(table)
    write_section("eval", table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
