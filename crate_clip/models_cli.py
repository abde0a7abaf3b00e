"""`crate-clip models [--json]`: the registered open_clip model configs of crate-clip, each with its parameters (image
tower, text tower, all) and the FLOPs of one image-caption pair at the config's own image size and text length,
counted by torch.utils.flop_counter on a meta-device build (no weights made; the planner's counter, towers deeper
than a few blocks counted on 1 and 2 blocks and extrapolated: exact, and seconds for all of them).

`crate-clip models --weights [--json]`: the released weights crate-clip knows (the CRATE-alpha paper's and CLIPA's,
crate_clip/models/released_weights.py): where each is, its size and reported accuracy, how it loads; then how a
run's own export loads."""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass

from crate_clip.core.cli_conventions import CommandParser, add_json_flag


@dataclass(frozen=True)
class ModelRow:
    """One registered model config, as `crate-clip models` lists it."""
    name: str
    image_size: int
    patch_size: int | None
    context_length: int
    image_params: int
    text_params: int
    params: int
    forward_gflops: float    # one image + one caption through both towers (and the contrastive logits), at
                             # image_size / context_length; attention counted as its matmuls
    train_gflops: float      # a training step per sample: forward, contrastive loss, backward


def build_parser() -> argparse.ArgumentParser:
    """The `crate-clip models` argument parser."""
    p = CommandParser(prog="crate-clip models", description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--filter", default=None, metavar="TEXT",
                   help="only the models whose name contains TEXT (case-insensitive)")
    p.add_argument("--weights", action="store_true",
                   help="list the released weights crate-clip knows (the CRATE-alpha paper's, CLIPA's): where each "
                        "is, its size, reported accuracy and how it loads; and how a run's own export loads")
    add_json_flag(p, "the table")
    return p


def format_weights(entries) -> str:
    """The released weights (ReleasedWeights), one block each."""
    blocks = []
    for w in entries:
        lines = [f"{w.name}: {w.what}", f"  where:    {w.where}"]
        lines += [f"  size:     {w.size}"] if w.size else []
        lines += [f"  reported: {w.reported}"] if w.reported else []
        lines += [f"  load:     {w.load}", f"  source:   {w.source}"]
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def list_weights(name_filter, as_json: bool) -> int:
    """`crate-clip models --weights`: the released weights (those whose name contains `name_filter`), then a run's
    own export."""
    from crate_clip.models.released_weights import LOCAL_EXPORT, RELEASED_WEIGHTS

    entries = [w for w in RELEASED_WEIGHTS if not name_filter or name_filter.lower() in w.name.lower()]
    if not entries:
        print(f"crate-clip models: no released weights match {name_filter!r}; fix: `crate-clip models --weights` "
              "lists them all", file=sys.stderr)
        return 2
    entries.append(LOCAL_EXPORT)
    print(json.dumps([asdict(w) for w in entries], indent=1, ensure_ascii=False) if as_json else
          format_weights(entries))
    return 0


def registered_models() -> list[str]:
    """The open_clip config names crate-clip registers (its model_configs/*.json), sorted."""
    from crate_clip.models.model_config_files import MODEL_CONFIG_DIR

    return sorted(path.stem for path in MODEL_CONFIG_DIR.glob("*.json"))


def model_row(name: str) -> ModelRow:
    """Parameters and FLOPs of config `name`, counted on the meta device."""
    import torch

    from crate_clip.models.clip_factory import create_clip
    from crate_clip.train.planning.planner import count_cut_per_sample

    model = create_clip(name, device="meta")
    visual = model.visual
    image_params = sum(p.numel() for p in visual.parameters())
    params = sum(p.numel() for p in model.parameters())
    size = visual.image_size[0] if isinstance(visual.image_size, (tuple, list)) else int(visual.image_size)
    patch = getattr(getattr(visual, "trunk", visual), "patch_size", None) or getattr(visual, "patch_size", None)
    patch = patch[0] if isinstance(patch, (tuple, list)) else patch
    with torch.random.fork_rng(devices=[]):   # a token mask draws from the global generator even on meta
        counts = count_cut_per_sample(model, size, model.context_length)
    return ModelRow(name, size, int(patch) if patch else None, int(model.context_length), image_params,
                    params - image_params, params, counts.forward_flops / 1e9, counts.flops / 1e9)


def format_table(rows: list[ModelRow]) -> str:
    """The rows as an aligned text table."""
    head = f"{'model':<38} {'image':>6} {'patch':>5} {'text':>5} {'image M':>9} {'text M':>8} {'total M':>9} " \
           f"{'fwd GFLOPs':>11} {'train GFLOPs':>13}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.name:<38} {r.image_size:>6} {r.patch_size or '-':>5} {r.context_length:>5} "
                     f"{r.image_params / 1e6:>9.2f} {r.text_params / 1e6:>8.2f} {r.params / 1e6:>9.2f} "
                     f"{r.forward_gflops:>11.3f} {r.train_gflops:>13.3f}")
    lines.append("image/text: the config's image px and text tokens; M: millions of parameters; FLOPs per "
                 "image-caption pair (fwd) and per training sample (forward + loss + backward)")
    return "\n".join(lines)


def main(argv=None) -> int:
    """Run `crate-clip models`; returns the exit code."""
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    if args.weights:   # data only: no model is built
        return list_weights(args.filter, args.json)
    import crate_clip  # noqa: F401  (registers the configs and the towers)

    names = [n for n in registered_models() if not args.filter or args.filter.lower() in n.lower()]
    if not names:
        print(f"crate-clip models: no registered model matches {args.filter!r}; fix: `crate-clip models` lists "
              "them all", file=sys.stderr)
        return 2
    rows = [model_row(name) for name in names]
    print(json.dumps([asdict(r) for r in rows], indent=1) if args.json else format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
