"""`crate-clip eval zeroshot|retrieval ...`: evaluate a model from the command line (torchrun for several ranks)."""
import argparse
import json
import os
import sys
from pathlib import Path

import torch

from crate_clip.models.checkpoint_errors import CheckpointMismatchError
from crate_clip.models.clip_tokenizers import TokenizerUnavailableError
from eval.class_sets import BUILTIN_TEMPLATES
from eval.distributed_batches import rank_and_world
from eval.model_loading import load_eval_model
from eval.stage_hook import run_eval

USAGE_ERRORS = (ValueError, FileNotFoundError, CheckpointMismatchError, TokenizerUnavailableError)


def _model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True,
                        help="open_clip model name, local-dir:FOLDER, or a DeepSpeed checkpoint folder "
                             "(<run>/checkpoints or one tag folder; any ZeRO stage)")
    parser.add_argument("--pretrained", help="weights file (.safetensors/.pt; ours or a released "
                                             "crate_alpha_CLIPA_*.pth) or DeepSpeed checkpoint for --model NAME")
    parser.add_argument("--data", required=True, help="val folder, flat folder (with --labels), or shards (.tar folder / {..} pattern)")
    parser.add_argument("--image-size", type=int, help="evaluate at this resolution (pos-embeds resized)")
    parser.add_argument("--bert-vocab", help="folder holding vocab.txt: the BERT tokenizer of CLIPA-text models "
                                             "without the HuggingFace hub (default: hub / HF cache, or what a "
                                             "DeepSpeed checkpoint recorded)")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--workers", type=int, default=4, help="data-loader worker processes per rank")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--max-images", type=int, help="evaluate on this many images (spread evenly) only")
    parser.add_argument("--output", type=Path, help="write the metrics as JSON here")
    parser.add_argument("--no-progress", action="store_true")


def build_parser() -> argparse.ArgumentParser:
    """The `crate-clip eval` argument parser."""
    parser = argparse.ArgumentParser(prog="crate-clip eval", description="zero-shot classification and retrieval")
    sub = parser.add_subparsers(dest="command", required=True)
    zs = sub.add_parser("zeroshot", help="zero-shot classification (top-1, top-5, mean per class)")
    _model_args(zs)
    zs.add_argument("--dataset", default="imagenet1k",
                    help="imagenet1k | fashion_mnist (built-in class names) | any name with --classnames or "
                         "classnames.txt beside the data")
    zs.add_argument("--classnames", help="file with one class name per line, in label order")
    zs.add_argument("--labels", help="ground-truth file for the flat val layout (`file label` lines, one label "
                                     "per line, or Kaggle's LOC_val_solution.csv)")
    zs.add_argument("--templates", help=f"{' | '.join(BUILTIN_TEMPLATES)} | a file of '{{}}' lines "
                                        "(default: openai for imagenet1k)")
    zs.add_argument("--per-class", action="store_true", help="print the per-class accuracy table")
    zs.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "crate_clip" / "zeroshot"),
                    help="text-classifier cache ('' disables)")
    rt = sub.add_parser("retrieval", help="image<->text recall@1/5/10 on captioned shards (.jpg + .txt)")
    _model_args(rt)
    return parser


def _init_distributed(device: str) -> None:
    # Under torchrun every rank evaluates its share of the images; counts are summed at the end.
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl" if device.startswith("cuda") else "gloo")
        if device.startswith("cuda"):
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))


def _spec(args) -> dict:
    spec = {"name": args.command, "type": args.command, "data": args.data, "batch_size": args.batch_size,
            "max_images": args.max_images, "num_workers": args.workers}
    if args.command == "zeroshot":
        spec.update(dataset=args.dataset, templates=args.templates, labels=args.labels, classnames=args.classnames)
    return spec


def _print_per_class(metrics: dict) -> None:
    print(f"{'class':<32} {'images':>7} {'top-1':>7} {'top-5':>7}")
    for row in metrics["per_class"]:
        top1, top5 = (f"{100 * row[k]:.1f}" if row[k] is not None else "-" for k in ("top1", "top5"))
        print(f"{row['class'][:32]:<32} {row['n']:>7} {top1:>7} {top5:>7}")


def _print_summary(command: str, metrics: dict) -> None:
    if command == "zeroshot":
        print(f"zero-shot: top-1 {100 * metrics['top1']:.2f}%  top-5 {100 * metrics['top5']:.2f}%  "
              f"mean per class {100 * metrics['mean_per_class']:.2f}%  on {metrics['n_images']} images "
              f"({metrics['n_unreadable']} unreadable)")
    else:
        print("retrieval: " + "  ".join(f"{k} {100 * v:.2f}%" for k, v in metrics.items() if "_R@" in k)
              + f"  on {metrics['n_pairs']} pairs ({metrics['n_unreadable']} unreadable)")


def main(argv=None) -> int:
    """Run `crate-clip eval ...`; returns the exit code."""
    args = build_parser().parse_args(argv)
    device = args.device if args.device != "cuda" else f"cuda:{os.environ.get('LOCAL_RANK', '0')}"
    _init_distributed(args.device)
    try:
        model, preprocess, tokenizer, _ = load_eval_model(args.model, args.pretrained, args.image_size, device,
                                                  bert_vocab=args.bert_vocab)
        cache_dir = getattr(args, "cache_dir", None) or None
        metrics = run_eval(model, tokenizer, preprocess, _spec(args), device=device, precision=args.precision,
                           cache_dir=cache_dir, progress=not args.no_progress)
    except USAGE_ERRORS as err:
        print(f"crate-clip eval: error: {err}", file=sys.stderr)
        return 2
    if rank_and_world()[0] == 0:
        if getattr(args, "per_class", False):
            _print_per_class(metrics)
        _print_summary(args.command, metrics)
        if args.output:
            args.output.parent.mkdir(parents=True, exist_ok=True)
            args.output.write_text(json.dumps({"model": args.model, "data": args.data, **metrics}, indent=1))
    return 0
