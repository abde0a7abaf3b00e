"""Fixtures for the eval tests: Fashion-MNIST eval sets on disk and a briefly trained tiny CLIP."""
import functools
import io
import json
import os
import sys
from pathlib import Path

import numpy as np
import open_clip
import torch
import torch.nn.functional as F
import webdataset as wds
from PIL import Image

import crate_clip  # noqa: F401  (registers the CRATE-alpha open_clip configs)
from crate_clip.data.sources.fashion_mnist import load_fashion_mnist
from crate_clip.eval.class_sets import FASHION_MNIST_CLASSNAMES

PER_CLASS = 16          # eval images per class -> 160 images
TRAIN_IMAGES = 2048
TRAIN_STEPS = 150


def balanced_subset(labels: np.ndarray, per_class: int) -> np.ndarray:
    """The first `per_class` indices of every class, in data order."""
    picks = [np.flatnonzero(labels == c)[:per_class] for c in range(10)]
    return np.sort(np.concatenate(picks))


def class_dir(label: int) -> str:
    """Folder name whose sorted order equals label order."""
    return f"{label:02d}_{FASHION_MNIST_CLASSNAMES[label].replace('/', '_').replace(' ', '_')}"


def _jpeg(image: np.ndarray) -> bytes:
    """A 28x28 grayscale array as JPEG bytes."""
    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="JPEG", quality=95)
    return buf.getvalue()


def write_eval_sets(root: Path, fashion_mnist_dir: Path) -> dict[str, Path]:
    """The first PER_CLASS test images of each class as an ImageFolder, a flat folder + label file, and .cls / .txt
    shards (conftest.py's `sets`, once per session)."""
    images, labels = load_fashion_mnist("test", fashion_mnist_dir)
    pick = balanced_subset(labels, PER_CLASS)
    images, labels = images[pick], labels[pick]
    folder, flat, shards, captions = root / "folder", root / "flat", root / "shards", root / "captions"
    for path in (folder, flat, shards, captions):
        path.mkdir(parents=True)
    label_lines = []
    with wds.TarWriter(str(shards / "00000000.tar")) as cls_sink, \
            wds.TarWriter(str(captions / "00000000.tar")) as txt_sink:
        for i, (img, label) in enumerate(zip(images, labels)):
            data, label, key = _jpeg(img), int(label), f"{i:012d}"
            (folder / class_dir(label)).mkdir(exist_ok=True)
            (folder / class_dir(label) / f"img_{i:05d}.jpg").write_bytes(data)
            (flat / f"val_{i:05d}.jpg").write_bytes(data)
            label_lines.append(f"val_{i:05d}.jpg {label}")
            cls_sink.write({"__key__": key, "jpg": data, "cls": str(label).encode()})
            caption = f"a photo of a {FASHION_MNIST_CLASSNAMES[label]}, item {i}."
            txt_sink.write({"__key__": key, "jpg": data, "txt": caption.encode()})
    (root / "flat_labels.txt").write_text("\n".join(label_lines) + "\n")
    for path in (folder, shards):
        (path / "classnames.txt").write_text("\n".join(FASHION_MNIST_CLASSNAMES) + "\n")
    return {"folder": folder, "flat": flat, "labels": root / "flat_labels.txt", "shards": shards,
            "captions": captions}


TINY_VIT_CONFIG = {
    "embed_dim": 64,
    "vision_cfg": {"image_size": 28, "layers": 2, "width": 64, "head_width": 32, "patch_size": 7},
    "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 64, "heads": 2, "layers": 2},
}
TINY_VIT_NAME = "evaltest-tiny-vit"


def register_tiny_vit(directory: Path) -> str:
    """Register the tiny ViT CLIP config with open_clip under TINY_VIT_NAME."""
    path = directory / f"{TINY_VIT_NAME}.json"
    path.write_text(json.dumps(TINY_VIT_CONFIG))
    open_clip.add_model_config(path)
    return TINY_VIT_NAME


def to_model_input(images: np.ndarray) -> torch.Tensor:
    """uint8 (N,28,28) -> the normalised (N,3,28,28) float batch open_clip's eval transform produces."""
    x = torch.from_numpy(images.copy()).float().div(255).unsqueeze(1).expand(-1, 3, -1, -1)
    mean = torch.tensor(open_clip.OPENAI_DATASET_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(open_clip.OPENAI_DATASET_STD).view(1, 3, 1, 1)
    return (x - mean) / std


def train_tiny_clip(model_name: str, images: np.ndarray, labels: np.ndarray, steps: int = TRAIN_STEPS,
                    seed: int = 0) -> torch.nn.Module:
    """A tiny CLIP whose projections are fitted to tell Fashion-MNIST classes apart (towers stay random).

    Only the two output projections are trained, on tower features computed once: a real, class-
    discriminative CLIP in seconds on a CPU (so evaluation numbers mean something).
    """
    torch.manual_seed(seed)
    model = open_clip.create_model(model_name).eval()
    tokenizer = open_clip.get_tokenizer(model_name)
    visual_proj, text_proj = model.visual.proj, model.text_projection
    with torch.no_grad():
        model.visual.proj, model.text_projection = None, None   # pooled tower outputs, before projection
        pooled_images = model.encode_image(to_model_input(images))
        pooled_texts = model.encode_text(tokenizer([f"a photo of a {c}." for c in FASHION_MNIST_CLASSNAMES]))
    model.visual.proj, model.text_projection = visual_proj, text_proj
    y = torch.from_numpy(labels.astype(np.int64))
    optimizer = torch.optim.Adam([visual_proj, text_proj], lr=1e-2)
    for _ in range(steps):
        image_feats = F.normalize(pooled_images @ visual_proj, dim=-1)
        text_feats = F.normalize(pooled_texts @ text_proj, dim=-1)
        loss = F.cross_entropy(20.0 * image_feats @ text_feats.T, y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.requires_grad_(False)


def train_tiny_vit(config_dir: Path, fashion_mnist_dir: Path) -> tuple[torch.nn.Module, str]:
    """(the tiny ViT CLIP trained for TRAIN_STEPS on Fashion-MNIST train, its open_clip name, registered with its
    config written into config_dir): conftest.py's `vit`, once per session."""
    name = register_tiny_vit(config_dir)
    images, labels = load_fashion_mnist("train", fashion_mnist_dir)
    return train_tiny_clip(name, images[:TRAIN_IMAGES], labels[:TRAIN_IMAGES]), name


@functools.cache   # one model per pytest process, shared by the modules that read it (none changes it)
def shared_crate_tiny() -> torch.nn.Module:
    """CRATE-alpha-CLIPA-tiny with seeded random weights (checkpoint round trips compare exactly)."""
    torch.manual_seed(0)
    return open_clip.create_model(CRATE_TINY).eval()


CRATE_TINY = "CRATE-alpha-CLIPA-tiny"


def write_tiny_export(out: Path) -> Path:
    """shared_crate_tiny as an open_clip export folder at `out` (the refusal tests edit copies of its files)."""
    from crate_clip.export.writer import export_open_clip

    model = shared_crate_tiny()
    export_open_clip({k: v.contiguous() for k, v in model.state_dict().items()}, CRATE_TINY, out,
                     image_size=model.visual.image_size[0], context_length=model.context_length)
    return out


def assert_accuracies_agree(got: dict, want: dict, flips: int = 1) -> None:
    """Zero-shot metrics of one model on the same images, batched differently or computed by other code: equal
    image counts, and accuracies at most `flips` images apart (other batch shapes run other kernels, and an
    arg-max between two logits equal to the last bits may then go either way). `got` is a zero_shot_evaluate
    result; `want` has any of its keys."""
    n = got["n_images"]
    assert want.get("n_images", n) == n
    classes = [c for c in got["per_class"] if c["n"]]
    bounds = {"top1": flips / n, "top5": flips / n,
              "mean_per_class": flips / (min(c["n"] for c in classes) * len(classes))}
    for key, bound in bounds.items():
        if key in want:
            assert abs(got[key] - want[key]) <= bound + 1e-12, (key, got[key], want[key])
    for g, w in (zip(got["per_class"], want["per_class"], strict=True) if "per_class" in want else ()):
        assert (g["class"], g["n"]) == (w["class"], w["n"])
        for key in ("top1", "top5"):
            same = g[key] is None if w[key] is None else abs(g[key] - w[key]) <= flips / g["n"] + 1e-12
            assert same, (key, g, w)


DIST_MAX_IMAGES = 73    # 37 + 36 images over 2 ranks in batches of 12: rank 0 makes 4 forward calls, rank 1 3 (+1 dummy)
DIST_BATCH = 12
DS_STAGES = (0, 2, 3)


def distributed_worker(workdir: str) -> None:
    """One rank (its RANK, WORLD_SIZE and rendezvous in the environment, as a launcher sets them): plain-model
    zero-shot split over ranks, then a DeepSpeed engine per ZeRO stage (one training step, evaluation through the
    engine, save_checkpoint). Rank 0 writes results.json."""
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    import deepspeed
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False   # else a one-minute g++ build on CPU
    deepspeed.init_distributed(dist_backend="gloo")
    from crate_clip.eval.class_sets import FASHION_MNIST_TEMPLATES
    from crate_clip.eval.eval_datasets import classification_dataset
    from crate_clip.eval.model_loading import eval_transform
    from crate_clip.eval.tasks.zeroshot import zero_shot_evaluate

    workdir = Path(workdir)
    tokenizer = open_clip.get_tokenizer(CRATE_TINY)

    def fresh_model():
        model = open_clip.create_model(CRATE_TINY)
        model.load_state_dict(torch.load(workdir / "init.pt", weights_only=True))
        return model

    def evaluate(model, **kwargs):
        dataset = classification_dataset(workdir / "shards", eval_transform(fresh_model()), dataset="fashion_mnist",
                                         num_classes=10)
        return zero_shot_evaluate(model, tokenizer, dataset, FASHION_MNIST_CLASSNAMES, FASHION_MNIST_TEMPLATES,
                                  batch_size=DIST_BATCH, max_images=DIST_MAX_IMAGES, progress=False, **kwargs)

    results = {"plain": evaluate(fresh_model().eval())}
    images = to_model_input(load_fashion_mnist("test")[0][:8])   # the Debian package's copy
    tokens = tokenizer([f"a photo of a {c}." for c in FASHION_MNIST_CLASSNAMES[:8]])
    for stage in DS_STAGES:
        model = fresh_model()
        model.logit_scale = torch.nn.Parameter(model.logit_scale.detach().reshape(1))   # DeepSpeed needs >= 1-D
        config = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1,
                  "zero_optimization": {"stage": stage}}
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                                          config=config)
        engine.train()
        loss = open_clip.ClipLoss()(*engine(image=images, text=tokens)[:3])
        engine.backward(loss)
        engine.step()
        cache = workdir / "cache" if stage == 3 else None
        results[f"engine{stage}"] = evaluate(engine, cache_dir=cache)
        if stage == 3:
            results["engine3_cached"] = evaluate(engine, cache_dir=cache)
        engine.save_checkpoint(str(workdir / f"ckpt{stage}"), tag="stage0_step1")
        if rank == 0:
            context = open_clip.get_model_config(CRATE_TINY)["text_cfg"]["context_length"]
            size = open_clip.get_model_config(CRATE_TINY)["vision_cfg"]["image_size"]
            info = {"model_name": CRATE_TINY, "image_size": size, "context_length": context, "zero_stage": stage,
                    "stage_index": 0, "stage_name": "stage0", "step": 1, "samples_seen": 8,
                    "logit_scale_shape": [1]}
            (workdir / f"ckpt{stage}" / "stage0_step1" / "crate_clip.json").write_text(json.dumps(info))
    if rank == 0:
        (workdir / "results.json").write_text(json.dumps(results))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    # leave without the interpreter's teardown, as tests/train_workers.py does: with every output written, C++
    # destructors at exit aborted a rank now and then ("terminate called without an active exception", SIGABRT),
    # which the launcher (fork_ranks.py) reports as a failed job
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
