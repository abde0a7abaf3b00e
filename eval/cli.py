"""`crate-clip eval zeroshot|retrieval ...`: evaluate a model from the command line (torchrun for several ranks)."""
import argparse
import json
import os
import sys
from pathlib import Path
from typing import get_args

# Light imports only up to build_parser: `crate-clip eval --help` and a refused option cost no torch import;
# the model, data and task code are imported by main() once the command line is parsed.
from crate_clip.checkpoint_io.trust_flag import TRUST_FLAG, TRUST_HELP, TRUST_WARNING
from crate_clip.core.cli_conventions import CommandParser, accept_old_name, add_json_flag, deprecation_warning
from crate_clip.core.cli_numbers import bounded
from crate_clip.core.resize_modes import RESOLUTION_RESIZE_MODES
from crate_clip.eval.eval_settings import EvalSettings
from crate_clip.eval.registry import TASK_SETTINGS, task_help
from crate_clip.eval.tasks.linear_probe import TIMM_PREFIX
# command-line option -> the shared eval setting it sets (defaults come from the settings schema)
COMMON_OPTIONS = {"--data": "data", "--batch-size": "batch_size", "--num-workers": "num_workers",
                  "--max-images": "max_images", "--max-unreadable-fraction": "max_unreadable_fraction"}


def _option(parser: argparse.ArgumentParser, flag: str, field, required: bool = False) -> None:
    default = "" if field.default is None or required else f" (default: {field.default})"
    kinds = (field.annotation, *get_args(field.annotation))
    kind = next((k for k in (int, float) if k in kinds), None)
    parser.add_argument(flag, dest=flag.lstrip("-").replace("-", "_"), required=required,
                        type=_bounded_type(kind, field), help=f"{field.description or ''}{default}")


def _bounded_type(kind, field):
    """The settings schema's bounds (ge, gt, le, lt) as the option's argparse type: a value outside them is
    refused while the command line is parsed, before the model is loaded (`--batch-size 0`, `--workers -1`)."""
    if kind is None:
        return None
    bounds = {name: getattr(m, name) for m in field.metadata for name in ("ge", "gt", "le", "lt") if hasattr(m, name)}
    return bounded(kind, **bounds) if bounds else kind


def _model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True,
                        help="open_clip model name, local-dir:FOLDER, or a DeepSpeed checkpoint folder "
                             "(<run>/checkpoints or one tag folder; any ZeRO stage); timm:NAME for a timm "
                             "classifier (linear_probe, tower features)")
    parser.add_argument("--pretrained", help="weights file (.safetensors/.pt; ours or a released "
                                             "crate_alpha_CLIPA_*.pth) or DeepSpeed checkpoint for --model NAME")
    for flag, key in COMMON_OPTIONS.items():
        _option(parser, flag, EvalSettings.model_fields[key], required=key == "data")
    accept_old_name(parser, "--workers", "--num-workers")   # one name across commands: the settings key's
    parser.add_argument("--image-size", type=int, help="evaluate at this resolution (how: --resize)")
    parser.add_argument("--resize", choices=RESOLUTION_RESIZE_MODES, default="grid",
                        help="how a model runs at another --image-size: grid (the patch grid grows or shrinks, "
                             "position embeddings resampled) or patch (the grid kept, the patch kernel PI-resized "
                             "as FlexiViT; CRATE-alpha towers) (default: grid)")
    parser.add_argument("--bert-vocab", help="folder holding vocab.txt: the BERT tokenizer of CLIPA-text models "
                                             "without the HuggingFace hub (default: hub / HF cache, or what a "
                                             "DeepSpeed checkpoint recorded)")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                        help="evaluation precision (default: fp32)")
    parser.add_argument("--device", help="torch device (default: cuda when available, else cpu)")
    parser.add_argument("--output", type=Path, help="write the metrics as JSON here")
    add_json_flag(parser, "the metrics")
    parser.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "crate_clip" / "zeroshot"),
                        help="cache of what a task can reuse, e.g. zero-shot text classifiers ('' disables)")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress display (a bar on a terminal, else plain lines on stderr)")
    parser.add_argument(TRUST_FLAG, dest="trust_checkpoint", action="store_true", help=TRUST_HELP)


# the tasks' own names where they differ from the hyphenated command (`linear_probe`): accepted, deprecated
OLD_TASK_NAMES = {name: name.replace("_", "-") for name in TASK_SETTINGS if "_" in name}


def canonical_argv(argv) -> list[str]:
    """`argv` with an old task name (`linear_probe`) replaced by its command (`linear-probe`), said in one line."""
    argv = list(argv)
    if argv and argv[0] in OLD_TASK_NAMES:
        deprecation_warning("crate-clip eval", argv[0], OLD_TASK_NAMES[argv[0]])
        argv[0] = OLD_TASK_NAMES[argv[0]]
    return argv


def _task_keys(name: str) -> list[str]:
    return [k for k in TASK_SETTINGS[name].model_fields if k not in EvalSettings.model_fields]


def build_parser() -> argparse.ArgumentParser:
    """The `crate-clip eval` argument parser: one sub-command per task of eval/tasks/."""
    parser = CommandParser(prog="crate-clip eval", description="evaluate a model: "
                                     + ", ".join(name.replace("_", "-") for name in TASK_SETTINGS))
    sub = parser.add_subparsers(dest="command", required=True)
    for name, settings in TASK_SETTINGS.items():
        # one naming style, hyphens (`eval linear-probe`, as `shards eval-shards`); the task's own name is still
        # accepted (canonical_argv), not offered
        cmd = sub.add_parser(name.replace("_", "-"), help=task_help(name))
        cmd.set_defaults(task=name)
        _model_args(cmd)
        for key in _task_keys(name):
            _option(cmd, "--" + key.replace("_", "-"), settings.model_fields[key])
        if settings.has_details:
            cmd.add_argument("--details", "--per-class", dest="details", action="store_true",
                             help="also print the task's detail table (e.g. per-class accuracy)")
        if getattr(settings, "has_per_image", False):
            cmd.add_argument("--per-image-out", type=Path, metavar="FILE",
                             help="also write each image's index, label and top-1 class as CSV lines here (for "
                                  "paired comparisons of two models on the same images)")
    return parser


def _init_distributed(device: str) -> None:
    # Under torchrun every rank evaluates its share of the images; counts are summed at the end.
    import torch

    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl" if device.startswith("cuda") else "gloo")
        if device.startswith("cuda"):
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))


def _settings(args) -> EvalSettings:
    """The task's settings from the options given (the others keep the schema's defaults)."""
    from crate_clip.eval.registry import parse_eval

    keys = list(COMMON_OPTIONS.values()) + _task_keys(args.task)
    given = {k: getattr(args, k) for k in keys if getattr(args, k, None) is not None}
    return parse_eval({"name": args.task, "type": args.task, **given})


def _default_device() -> str:
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def main(argv=None) -> int:
    """Run `crate-clip eval ...`; returns the exit code."""
    args = build_parser().parse_args(canonical_argv(sys.argv[1:] if argv is None else argv))
    args.device = args.device or _default_device()
    return _evaluate(args)


def _write_per_image(args, rows) -> None:
    # CSV, not the metrics JSON: 10,000 rows would drown the summary and results files.
    if rows is not None:
        args.per_image_out.parent.mkdir(parents=True, exist_ok=True)
        args.per_image_out.write_text("index,label,top1\n" + "".join(f"{i},{y},{p}\n" for i, y, p in rows))


def _evaluate(args) -> int:
    """The parsed command: load the model, run the task, print (and write) its metrics."""
    from crate_clip.checkpoint_io.safe_unpickling import trusted_checkpoints
    from crate_clip.core.errors import report_error
    from crate_clip.eval.distributed_batches import rank_and_world
    from crate_clip.eval.model_loading import load_eval_model
    from crate_clip.eval.registry import EvalContext, run_task, task_module
    from crate_clip.eval.tasks.linear_probe import load_timm_classifier
    from crate_clip.models.checkpoint_errors import CheckpointMismatchError
    from crate_clip.models.clip_tokenizers import TokenizerUnavailableError

    usage_errors = (ValueError, FileNotFoundError, CheckpointMismatchError, TokenizerUnavailableError)
    device = args.device if args.device != "cuda" else f"cuda:{os.environ.get('LOCAL_RANK', '0')}"
    _init_distributed(args.device)
    if args.trust_checkpoint and rank_and_world()[0] == 0:
        print(TRUST_WARNING, file=sys.stderr)
    try:
        settings = _settings(args)
        if args.model.startswith(TIMM_PREFIX):   # a timm classifier: tower features (linear_probe)
            model, preprocess = load_timm_classifier(args.model[len(TIMM_PREFIX):], args.pretrained,
                                                     args.image_size, device)
            tokenizer = None
        else:
            with trusted_checkpoints(args.trust_checkpoint):
                model, preprocess, tokenizer, _ = load_eval_model(args.model, args.pretrained, args.image_size,
                                                                  device, bert_vocab=args.bert_vocab,
                                                                  resize=args.resize)
        context = EvalContext(tokenizer=tokenizer, preprocess=preprocess, device=device, precision=args.precision,
                              cache_dir=args.cache_dir or None, progress=not args.no_progress,
                              per_image=getattr(args, "per_image_out", None) is not None)
        metrics = run_task(model, settings, context)
    except usage_errors as err:
        return report_error("crate-clip eval", err)
    if rank_and_world()[0] == 0:
        _write_per_image(args, metrics.pop("per_image", None))
        task = task_module(args.task)
        record = {"model": args.model, "data": args.data, "task": args.task.replace("_", "-"), **metrics}
        if args.json:
            print(json.dumps(record, indent=1))
        else:
            if getattr(args, "details", False):
                print(task.details(metrics))
            print(task.summary(metrics))
        if args.output:
            args.output.parent.mkdir(parents=True, exist_ok=True)
            args.output.write_text(json.dumps({"model": args.model, "data": args.data, **metrics}, indent=1))
    return 0
