"""`crate-clip shards ...`: write DataComp-layout shards from local data, eval sets, and inspect a stream."""
from __future__ import annotations

import argparse
import json
import sys

from crate_clip.core.cli_conventions import CommandParser, accept_old_name
from crate_clip.core.cli_numbers import NON_NEGATIVE_INT, POSITIVE_INT
from crate_clip.core.errors import report_error
from crate_clip.core.read_bounds import MAX_CAPTION_BYTES as DEFAULT_MAX_CAPTION_BYTES
from crate_clip.core.read_bounds import MAX_IMAGE_BYTES as DEFAULT_MAX_IMAGE_BYTES
from crate_clip.core.read_bounds import MAX_MEMBER_BYTES as DEFAULT_MAX_MEMBER_BYTES
from crate_clip.core.read_bounds import MAX_SAMPLE_BYTES as DEFAULT_MAX_SAMPLE_BYTES
from crate_clip.core.writable_folders import UnwritableFolderError, check_writable


def _add_writer_args(p: argparse.ArgumentParser, default_max_side: int | None = 512) -> None:
    """Options shared by every shard-writing command."""
    p.add_argument("--out", required=True, help="output folder for {shard:08d}.tar + _stats.json")
    p.add_argument("--samples-per-shard", type=POSITIVE_INT, default=10_000,
                   help="samples per .tar shard (default: 10,000)")
    p.add_argument("--max-side", type=NON_NEGATIVE_INT, default=default_max_side,
                   help="shrink images whose longer side exceeds this (DataComp: 512; 0 keeps sizes)")
    p.add_argument("--parquet", action="store_true", help="also write {shard:08d}.parquet (needs pyarrow)")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress display (a bar on a terminal, else plain lines on stderr)")
    _add_json(p)
    p.add_argument("--dataset-name", metavar="NAME", default=None,
                   help="the data set's name for model cards, recorded in OUT/dataset.json (the fashion-mnist "
                        "command records 'Fashion-MNIST' itself)")


def _add_max_images(p: argparse.ArgumentParser) -> None:
    """`--max-images N` (one name across commands; the old `--limit` still works, with a warning)."""
    p.add_argument("--max-images", type=POSITIVE_INT, default=None,
                   help="write only the first N samples (default: all)")
    accept_old_name(p, "--limit", "--max-images")


def _add_json(p: argparse.ArgumentParser) -> None:
    # every shards command prints its result as JSON; --json says so explicitly, as on the other commands
    p.add_argument("--json", action="store_true", help="print the result as JSON (what shards always prints)")


def _parser() -> argparse.ArgumentParser:
    """Argument parser of `crate-clip shards`."""
    parser = CommandParser(prog="crate-clip shards", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("fashion-mnist", help="Fashion-MNIST idx files -> captioned shards")
    _add_writer_args(p, default_max_side=None)
    p.add_argument("--split", default="train", choices=("train", "test"), help="Fashion-MNIST split (default: train)")
    p.add_argument("--source-dir", default=None, help="folder of the idx .gz files (default: auto-found)")
    _add_max_images(p)
    p.add_argument("--upscale", type=POSITIVE_INT, default=None, help="resize the 28 px images to this size")

    p = sub.add_parser("folder", help="ImageFolder tree <root>/<class>/<image> -> shards captioned by class")
    p.add_argument("root", help="ImageFolder root: <root>/<class>/<image>")
    _add_writer_args(p)

    p = sub.add_parser("table", help="CSV/TSV/parquet table of image path + caption -> shards")
    p.add_argument("table", help="CSV/TSV/parquet file with an image-path and a caption column")
    p.add_argument("--image-col", default="image", help="column of image paths (default: image)")
    p.add_argument("--caption-col", default="caption", help="column of captions (default: caption)")
    p.add_argument("--root", default=None, help="folder that relative image paths are relative to")
    _add_writer_args(p)

    p = sub.add_parser("emoji", help="Noto Color Emoji renderings captioned with their Unicode names")
    _add_writer_args(p)
    _add_max_images(p)
    p.add_argument("--size", type=POSITIVE_INT, default=136, help="canvas size in px")

    p = sub.add_parser("eval-folder", help="Fashion-MNIST split as an ImageNet-val-style ImageFolder")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--split", default="test", choices=("train", "test"), help="Fashion-MNIST split (default: test)")
    p.add_argument("--source-dir", default=None, help="folder of the Fashion-MNIST idx .gz files (default: auto-found)")
    _add_max_images(p)
    _add_json(p)

    p = sub.add_parser("eval-shards", help="Fashion-MNIST split as classification shards (.jpg + .cls) in "
                                           "CLIP_benchmark's wds/ layout (OUT/<split>/N.tar, classnames, templates)")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--split", default="test", choices=("train", "test"), help="Fashion-MNIST split (default: test)")
    p.add_argument("--source-dir", default=None, help="folder of the Fashion-MNIST idx .gz files (default: auto-found)")
    _add_max_images(p)
    p.add_argument("--samples-per-shard", type=POSITIVE_INT, default=10_000,
                   help="samples per .tar shard (default: 10,000)")
    _add_json(p)

    p = sub.add_parser("scenes", help="segmentation eval set: 1-3 Fashion-MNIST test objects on textured "
                                      "backgrounds, ground-truth silhouette masks as COCO RLE in each .json")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--count", type=POSITIVE_INT, default=500, help="number of scenes (default: 500)")
    p.add_argument("--size", type=POSITIVE_INT, default=56, help="square scene side in px")
    p.add_argument("--max-objects", type=POSITIVE_INT, default=3, help="objects per scene, at most (default: 3)")
    p.add_argument("--seed", type=int, default=0, help="random seed of the layouts (default: 0)")
    p.add_argument("--source-dir", default=None, help="folder of the Fashion-MNIST idx .gz files (default: auto-found)")
    p.add_argument("--samples-per-shard", type=POSITIVE_INT, default=10_000,
                   help="samples per .tar shard (default: 10,000)")
    _add_json(p)

    p = sub.add_parser("inspect", help="stream a few batches from shards and print sizes, skips, POS source")
    p.add_argument("sources", nargs="+", help="brace patterns, folders, globs, pipe: commands")
    p.add_argument("--batches", type=POSITIVE_INT, default=2,
                   help="batches to read (epoch mode stops at the end of the pass)")
    p.add_argument("--batch-size", type=POSITIVE_INT, default=16, help="samples per batch (default: 16)")
    p.add_argument("--image-size", type=POSITIVE_INT, default=84, help="crop size in px (default: 84)")
    p.add_argument("--context-length", type=POSITIVE_INT, default=8, help="text tokens per caption (default: 8)")
    p.add_argument("--text-mask", default="syntax", choices=("truncate", "random", "block", "syntax"),
                   help="how captions are cut to the context length (default: syntax)")
    p.add_argument("--mode", default="resampled", choices=("resampled", "epoch"),
                   help="shard sampling: resampled (with replacement) or one epoch pass (default: resampled)")
    p.add_argument("--num-workers", type=NON_NEGATIVE_INT, default=0, help="data-loader worker processes (default: 0)")
    p.add_argument("--num-samples", type=POSITIVE_INT, default=None,
                   help="samples per epoch of the stream (default: the shards' count; given, no stats are read and "
                        "the report has no shard_sizes)")
    p.add_argument("--max-member-bytes", type=POSITIVE_INT, default=DEFAULT_MAX_MEMBER_BYTES,
                   help=f"skip samples with a tar member above this size, unread (default: {DEFAULT_MAX_MEMBER_BYTES})")
    p.add_argument("--max-caption-bytes", type=POSITIVE_INT, default=DEFAULT_MAX_CAPTION_BYTES,
                   help=f"skip samples whose caption is above this size, unread (default: {DEFAULT_MAX_CAPTION_BYTES})")
    p.add_argument("--max-sample-bytes", type=POSITIVE_INT, default=DEFAULT_MAX_SAMPLE_BYTES,
                   help="skip samples whose members together (each with its 512-byte header) are above this size, "
                        f"the rest of them unread (default: {DEFAULT_MAX_SAMPLE_BYTES})")
    p.add_argument("--max-image-bytes", type=POSITIVE_INT, default=DEFAULT_MAX_IMAGE_BYTES,
                   help="skip images that would decode to more bytes than this (width x height x channels x bytes "
                        f"per channel, from the header; default: {DEFAULT_MAX_IMAGE_BYTES})")
    _add_json(p)
    return parser


def _write(args, samples, total=None, description="writing shards") -> dict:
    """Run write_shards with the common options."""
    from .shard_writer import write_shards

    return write_shards(samples, args.out, args.samples_per_shard, max_side=args.max_side or None,
                        write_parquet=args.parquet, progress=not args.no_progress, total=total,
                        description=description)


def _inspect(args) -> dict:
    """Stream a few batches and summarise them."""
    from .text_reduction import load_tokenizer
    from .train_stream import StreamConfig, build_train_stream

    cfg = StreamConfig(sources=args.sources, mode=args.mode, num_workers=args.num_workers,
                       num_samples=args.num_samples, drop_last=False,   # count every sample read
                       max_member_bytes=args.max_member_bytes, max_caption_bytes=args.max_caption_bytes,
                       max_sample_bytes=args.max_sample_bytes, max_image_bytes=args.max_image_bytes)
    stream = build_train_stream(cfg, image_size=args.image_size, context_length=args.context_length,
                                text_mask=args.text_mask, batch_size=args.batch_size)
    tok = load_tokenizer()
    shapes, captions, samples_read = [], [], 0
    for i, (images, tokens) in enumerate(stream):
        shapes.append([list(images.shape), list(tokens.shape)])
        samples_read += len(images)
        captions += [tok.decode([t for t in row.tolist() if t not in (0, tok.sot_token_id, tok.eot_token_id)]).strip()
                     for row in tokens[:3]]
        if i + 1 >= args.batches:
            break
    # num_samples is what the shards' stats claim; samples_read what this pass decoded (--mode epoch with
    # enough --batches reads the whole data set: the two differ by the bad samples the stats count).
    report = {"num_samples": stream.num_samples, "samples_read": samples_read, "pos_source": stream.pos_source,
              "batches": shapes, "example_texts": captions, "skip_counts": stream.skip_counts()}
    if stream.census is not None:   # what the shards hold: missing, truncated, img2dataset's own counts
        report["shard_sizes"] = stream.census.report()
    return report


def main(argv=None) -> int:
    """Entry point of `crate-clip shards`; returns the exit code."""
    args = _parser().parse_args(argv)
    try:
        if getattr(args, "out", None):   # a read-only folder: said before any sample is read
            check_writable(args.out, "--out")
        if args.command == "fashion-mnist":
            from .sources.fashion_mnist import write_fashion_mnist_shards

            result = write_fashion_mnist_shards(args.out, args.split, args.samples_per_shard, args.source_dir,
                                                args.max_images, progress=not args.no_progress, upscale=args.upscale)
        elif args.command == "folder":
            from .sources.image_folder import image_folder_samples

            result = _write(args, image_folder_samples(args.root), description=f"folder {args.root}")
        elif args.command == "table":
            from .sources.table import table_samples

            result = _write(args, table_samples(args.table, args.image_col, args.caption_col, args.root),
                            description=f"table {args.table}")
        elif args.command == "emoji":
            from .sources.emoji import emoji_samples

            result = _write(args, emoji_samples(args.max_images, args.size), description="emoji")
        elif args.command == "eval-folder":
            from .eval_sets import image_folder_count
            from .sources.fashion_mnist import write_fashion_mnist_eval_folder

            folder = write_fashion_mnist_eval_folder(args.out, args.split, args.source_dir, args.max_images)
            result = {"out_dir": str(folder), "samples": image_folder_count(folder),   # as eval-shards says them
                      "classnames": str(folder / "classnames.txt")}
        elif args.command == "eval-shards":
            from .sources.fashion_mnist import write_fashion_mnist_classification_shards

            result = write_fashion_mnist_classification_shards(args.out, args.split, args.samples_per_shard,
                                                               args.source_dir, args.max_images)
        elif args.command == "scenes":
            from .sources.composite_scenes import write_composite_scene_shards

            result = write_composite_scene_shards(args.out, args.count, args.size, args.max_objects, args.seed,
                                                  args.samples_per_shard, args.source_dir)
        else:
            result = _inspect(args)
    except (FileNotFoundError, KeyError, ValueError, UnwritableFolderError) as exn:
        return report_error(f"crate-clip shards {args.command}", exn)
    if getattr(args, "dataset_name", None):   # after the writer's own record: the user's name wins
        from crate_clip.core.dataset_records import DatasetRecord, write_dataset_record

        write_dataset_record(args.out, DatasetRecord(args.dataset_name))
    summary = {k: v for k, v in result.items() if k != "shards"}
    if "shards" in result:
        summary["num_shards"] = len(result["shards"])
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
