"""`crate-clip inspect maps|text ...` and `crate-clip segment ...`: attention / PCA maps, the text tower's attention
and dictionary atoms, and MaskCut segmentation."""
from __future__ import annotations

import argparse
import io
import json
import sys
from pathlib import Path

import numpy as np
from PIL import Image

from crate_clip.checkpoint_io.trust_flag import TRUST_FLAG, TRUST_HELP, TRUST_WARNING
from crate_clip.core.cli_conventions import CommandParser, accept_old_name, did_you_mean
from crate_clip.core.cli_numbers import NON_NEGATIVE_INT, POSITIVE_INT, bounded
from crate_clip.core.errors import report_error
from crate_clip.eval.maskcut import DEFAULT_MASKS, DEFAULT_TAU

USAGE_ERRORS = (ValueError, FileNotFoundError, TypeError)
# MaskCut's edges are the patch pairs whose cosine similarity exceeds tau: from 1 on there are none
TAU = bounded(float, ge=0, lt=1, meaning="a cosine-similarity threshold")


def _source_args(p: argparse.ArgumentParser) -> None:
    """The options naming the model to load (every inspect / segment command)."""
    p.add_argument("--model", required=True, help="open_clip model name, local-dir:FOLDER, or a DeepSpeed checkpoint")
    p.add_argument("--pretrained", help="weights file or DeepSpeed checkpoint for --model NAME (none: random init)")
    p.add_argument(TRUST_FLAG, dest="trust_checkpoint", action="store_true", help=TRUST_HELP)


def _model_args(p: argparse.ArgumentParser) -> None:
    _source_args(p)
    p.add_argument("--image-size", type=POSITIVE_INT, help="square input size (position embeddings resized)")
    p.add_argument("--layer", type=int, default=-1, help="block index (negative: from the end; default the last)")
    p.add_argument("--out", required=True, type=Path, help="output folder")


def _load_model(args, **options):
    """(model, transform, tokenizer, name) of --model / --pretrained, read as --trust-checkpoint allows."""
    import torch

    from crate_clip.checkpoint_io.safe_unpickling import trusted_checkpoints
    from crate_clip.eval.model_loading import load_eval_model

    torch.manual_seed(0)  # a random-init tower (no --pretrained) is the same on every call
    if args.trust_checkpoint:
        print(TRUST_WARNING, file=sys.stderr)
    with trusted_checkpoints(args.trust_checkpoint):
        return load_eval_model(args.model, args.pretrained, **options)


def _load(args):
    return _load_model(args, image_size=args.image_size)[0].float().eval()


def patch_grid(clip) -> tuple[int, int]:
    """(rows, columns) of the image tower's patch grid at its input size."""
    from crate_clip.eval.whitebox import find_crate_tower

    tower = find_crate_tower(clip) or getattr(getattr(clip, "module", clip), "visual", None)
    return tuple(tower.grid_size)


def open_image(source, grid: tuple[int, int]) -> tuple[Image.Image | None, str | None]:
    """(RGB image, None), or (None, why it is skipped): not decodable, or smaller than the patch grid (each
    patch would see less than a pixel of its own, and every mask would be degenerate)."""
    from crate_clip.eval.eval_datasets import DECODE_ERRORS

    try:
        with Image.open(io.BytesIO(source) if isinstance(source, bytes) else source) as im:
            image = im.convert("RGB")
    except DECODE_ERRORS as exn:
        return None, f"unreadable: {type(exn).__name__}"
    if image.height < grid[0] or image.width < grid[1]:
        return None, f"{image.width}x{image.height} px, smaller than the model's {grid[1]}x{grid[0]} patch grid"
    return image, None


def _read_images(paths: list[str], grid: tuple[int, int], skipped: list[str]) -> list[tuple[str, Image.Image]]:
    """(path, image) of the usable --images; the others are appended to `skipped` as 'path (why)'."""
    images = []
    for p in paths:
        if not Path(p).is_file():
            raise FileNotFoundError(f"--images: {p} does not exist")
        image, why = open_image(p, grid)
        if image is None:
            skipped.append(f"{p} ({why})")
        else:
            images.append((p, image))
    return images


def _report_skipped(prog: str, skipped: list[str], total: int, kept: int) -> None:
    """One line on stderr naming the skipped images; an error when none was usable."""
    if kept == 0:
        raise ValueError(f"none of the {total} images is usable: {'; '.join(skipped[:5])}")
    if skipped:
        more = f"; ... ({len(skipped)} in all)" if len(skipped) > 5 else ""
        print(f"{prog}: skipped {len(skipped)} of {total} images: {'; '.join(skipped[:5])}{more}", file=sys.stderr)


# ---------------------------------------------------------------- inspect maps
def maps_main(argv) -> int:
    """`crate-clip inspect maps`: class-token attention per head + average, and joint PCA, per image."""
    p = CommandParser(prog="crate-clip inspect maps", description=maps_main.__doc__)
    _model_args(p)
    p.add_argument("--images", nargs="+", required=True)
    p.add_argument("--facet", default="projection", choices=("projection", "output"),
                   help="PCA features: U^T LN(Z) (ViT: keys) or the block output (default projection)")
    p.add_argument("--json", action="store_true", help="print the result as JSON (what inspect maps always prints)")
    args = p.parse_args(argv)
    import torch   # after parsing (seconds of CPU): --help is instant

    with torch.no_grad():
        return _maps(args, p)


def _maps(args, p: argparse.ArgumentParser) -> int:
    """maps_main once its command line is parsed: the model loaded, the outputs written."""
    from crate_clip.eval.segmentation import to_tensor
    from crate_clip.eval.whitebox_maps import attention_strip, block_maps, joint_pca, pca_strip

    clip = _load(args)
    skipped = []
    kept = _read_images(args.images, patch_grid(clip), skipped)
    _report_skipped(p.prog, skipped, len(args.images), len(kept))
    paths, images = [k[0] for k in kept], [k[1] for k in kept]
    x = to_tensor(images, clip)
    last = block_maps(clip, x, -1)
    depth = _depth(clip)
    layers = sorted({(args.layer if args.layer >= 0 else depth + args.layer), depth - 1})
    args.out.mkdir(parents=True, exist_ok=True)
    shown = [im.resize((x.shape[-1], x.shape[-2]), Image.BICUBIC) for im in images]
    for layer in layers:
        maps = last if layer == depth - 1 else block_maps(clip, x, layer)
        attn = maps.cls_attention().cpu().numpy()
        for path, im, a in zip(paths, shown, attn):
            attention_strip(im, a).save(args.out / f"{Path(path).stem}_attn_layer{layer}.png")
    pca_layer = layers[0] if args.layer != -1 else depth - 1
    maps = last if pca_layer == depth - 1 else block_maps(clip, x, pca_layer)
    pca = joint_pca(maps.patch_features(args.facet).cpu().numpy(), 4)
    for path, im, comp in zip(paths, shown, pca):
        pca_strip(im, comp, maps.grid).save(args.out / f"{Path(path).stem}_pca.png")
    print(json.dumps({"out": str(args.out), "images": len(images), "skipped": len(skipped), "attention_layers": layers,
                      "pca_layer": pca_layer}))
    return 0


# ---------------------------------------------------------------- inspect text
def text_main(argv) -> int:
    """`crate-clip inspect text CAPTION`: per-head attention over the words and the most active dictionary atoms per
    token, at one block of a CRATE-alpha text tower; per-block coding rate and code sparsity of the caption."""
    p = CommandParser(prog="crate-clip inspect text", description=text_main.__doc__)
    p.add_argument("caption")
    _source_args(p)
    p.add_argument("--bert-vocab", help="folder with vocab.txt for a BERT-tokenized model (offline)")
    p.add_argument("--layer", type=int, default=-1, help="block index (negative: from the end; default the last)")
    p.add_argument("--atoms", type=POSITIVE_INT, default=5, help="dictionary atoms shown per token (default 5)")
    p.add_argument("--json", action="store_true", help="print the inspection as JSON instead of tables")
    p.add_argument("--out", type=Path, help="also draw the attention heatmaps into this folder (PNG)")
    args = p.parse_args(argv)
    import torch   # after parsing (seconds of CPU): --help is instant

    with torch.no_grad():
        return _text(args, p)


def _text(args, p: argparse.ArgumentParser) -> int:
    """text_main once its command line is parsed: the model loaded, the outputs written."""
    from crate_clip.eval.whitebox_text import draw_attention, format_inspection, inspect_caption

    clip, _, tokenizer, _ = _load_model(args, bert_vocab=args.bert_vocab)
    ins = inspect_caption(clip.float().eval(), tokenizer, args.caption, args.layer, args.atoms)
    print(json.dumps(ins.__dict__) if args.json else format_inspection(ins))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        draw_attention(ins, args.out / f"text_attention_block{ins.layer}.png")
    return 0


def _depth(clip) -> int:
    from crate_clip.eval.whitebox import find_crate_tower

    trunk = find_crate_tower(clip)
    return len(trunk.blocks) if trunk is not None else len(clip.visual.transformer.resblocks)


# ---------------------------------------------------------------- segment
def scene_shards(data: str, limit: int | None = None, grid: tuple[int, int] = (1, 1), skipped: list | None = None):
    """(key, PIL image, ground truth {height, width, objects}) from composite-scene shards (`crate-clip shards
    scenes`), read by the bounded reader of every shard (eval_datasets.tar_samples); scenes whose image is unusable
    (see `open_image`), or which that reader skips, are appended to `skipped` as 'key (why)'."""
    from crate_clip.eval.eval_datasets import shard_urls, tar_samples

    skipped = [] if skipped is None else skipped
    count = 0
    for url in shard_urls(data):
        members = {}
        for sample in tar_samples(url):
            if "__unreadable_tar__" in sample:
                skipped.append(f"{url}:{sample.get('__key__', '')} ({sample['__unreadable_tar__']})")
            else:
                members[sample["__key__"]] = sample
        for key in sorted(members):
            parts = members[key]
            if "jpg" not in parts or "json" not in parts:
                continue
            meta = json.loads(parts["json"])
            if "objects" not in meta:
                raise ValueError(f"{url}: sample {key} has no 'objects' (not a segmentation set from "
                                 f"`crate-clip shards scenes`)")
            image, why = open_image(parts["jpg"], grid)
            if image is None:
                skipped.append(f"{url}:{key} ({why})")
                continue
            yield key, image, {"height": image.height, "width": image.width, "objects": meta["objects"]}
            count += 1
            if limit is not None and count >= limit:
                return


def segment_main(argv) -> int:
    """`crate-clip segment`: MaskCut masks as PNG overlays + COCO RLE JSON; with --data, AP50 and best IoU too."""
    p = segment_parser()
    args = p.parse_args(argv)
    import torch   # after parsing (seconds of CPU): --help is instant

    with torch.no_grad():
        return _segment(args, p)


def segment_parser() -> CommandParser:
    """The `crate-clip segment` argument parser."""
    p = CommandParser(prog="crate-clip segment", description=segment_main.__doc__)
    _model_args(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--images", nargs="+", help="image files")
    src.add_argument("--data", help="composite-scene shards with ground truth (evaluates class-agnostic AP50)")
    p.add_argument("--max-images", type=POSITIVE_INT, help="with --data: the first N scenes only")
    accept_old_name(p, "--limit", "--max-images")   # one name across commands
    p.add_argument("--facet", default="projection", choices=("projection", "output"),
                   help="MaskCut features: U^T LN(Z) of the block (ViT: attention keys) or its output tokens")
    p.add_argument("--tau", type=TAU, default=DEFAULT_TAU,
                   help="affinity threshold on the patches' cosine similarity, in [0, 1) (default 0.3)")
    p.add_argument("--masks", type=POSITIVE_INT, default=DEFAULT_MASKS,
                   help="at most this many masks per image (default 3)")
    p.add_argument("--batch-size", type=POSITIVE_INT, default=64, help="images per forward (default 64)")
    p.add_argument("--overlays", type=NON_NEGATIVE_INT, default=None,
                   help="write at most this many overlay PNGs (default all)")
    p.add_argument("--json", action="store_true", help="print the result as JSON (what segment always prints)")
    return p


def _segment(args, p: argparse.ArgumentParser) -> int:
    """segment_main once its command line is parsed: the model loaded, the outputs written."""
    from crate_clip.eval.segmentation import coco_evaluate, mask_records, overlay_masks, segment_batch, write_results

    clip = _load(args)
    skipped = []
    if args.images:
        items = [(Path(path).stem, im, None, path) for path, im in _read_images(args.images, patch_grid(clip), skipped)]
    else:
        items = [(key, im, gt, key)
                 for key, im, gt in scene_shards(args.data, args.max_images, patch_grid(clip), skipped)]
        if not items and not skipped:
            raise ValueError(f"--data {args.data}: no samples found")
    _report_skipped(p.prog, skipped, len(items) + len(skipped), len(items))
    args.out.mkdir(parents=True, exist_ok=True)
    results, predictions = [], []
    for start in range(0, len(items), args.batch_size):
        chunk = items[start:start + args.batch_size]
        masks = segment_batch(clip, [c[1] for c in chunk], layer=args.layer, facet=args.facet, tau=args.tau,
                              n_masks=args.masks)
        for (stem, im, _, name), ms in zip(chunk, masks):
            records = mask_records(ms)
            predictions.append(records)
            results.append({"image": str(name), "stem": stem, "height": im.height, "width": im.width, "masks": records})
            if args.overlays is None or len(results) <= args.overlays:
                overlay_masks(im, ms).save(args.out / f"{stem}_segments.png")
    summary = {"out": str(write_results(results, args.out)), "images": len(results), "skipped": len(skipped),
               "masks": sum(len(r["masks"]) for r in results)}
    if args.data:
        metrics = coco_evaluate([c[2] for c in items], predictions)
        metrics.update(model=args.model, pretrained=args.pretrained, layer=args.layer, facet=args.facet,
                       tau=args.tau, image_size=args.image_size)
        (args.out / "metrics.json").write_text(json.dumps(metrics, indent=1))
        summary["metrics"] = metrics
    print(json.dumps(summary, indent=1))
    return 0


def _run(fn, argv, prog) -> int:
    try:
        return fn(argv)   # each command runs under torch.no_grad once parsed
    except USAGE_ERRORS as exn:
        return report_error(prog, exn)


INSPECT_COMMANDS = {"maps": maps_main, "text": text_main}


def inspect_entry(argv=None) -> int:
    """`crate-clip inspect maps ...` (image tower) or `crate-clip inspect text ...` (CRATE-alpha text tower)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    usage = ("usage: crate-clip inspect maps --model ... --images ... --out DIR [--layer N]\n"
             "       crate-clip inspect text CAPTION --model ... [--layer N] [--atoms K] [--json] [--out DIR]\n"
             "(crate-clip inspect maps --help / text --help: their options)")
    if argv and argv[0] in ("-h", "--help"):   # asked for: the usage, exit 0 as every --help
        print(usage)
        return 0
    if not argv or argv[0] not in INSPECT_COMMANDS:
        unknown = f"crate-clip inspect: unknown command {argv[0]!r}{did_you_mean(argv[0], INSPECT_COMMANDS)}\n" \
            if argv else ""
        print(unknown + usage, file=sys.stderr)
        return 2
    return _run(INSPECT_COMMANDS[argv[0]], argv[1:], f"crate-clip inspect {argv[0]}")


def segment_entry(argv=None) -> int:
    """`crate-clip segment ...`."""
    return _run(segment_main, list(sys.argv[1:] if argv is None else argv), "crate-clip segment")
