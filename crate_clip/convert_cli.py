"""`crate-clip convert official CHECKPOINT --model NAME --out DIR`: a released CRATE-alpha-CLIPA `.pth` as an
open_clip `local-dir:` export (safetensors, open_clip_config.json with the model's preprocessing, and the
tokenizer files), which plain open_clip loads after `import crate_clip`."""
import argparse
import sys
from pathlib import Path

from crate_clip.cli_errors import USER_ERRORS, report_error
from crate_clip.models import clip_tokenizer, load_official_clipa
from crate_clip.train.export import export_open_clip, export_state_equal, load_export


def build_parser() -> argparse.ArgumentParser:
    """The `crate-clip convert` argument parser."""
    parser = argparse.ArgumentParser(prog="crate-clip convert", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    off = sub.add_parser("official", help="a released crate_alpha_CLIPA_{L14,H14}.pth (UCSC-VLAA/CRATE-alpha)")
    off.add_argument("checkpoint", type=Path, help="the .pth file (a plain state dict, loaded weights_only)")
    off.add_argument("--model", default="CRATE-alpha-CLIPA-L-14",
                     help="open_clip config name: CRATE-alpha-CLIPA-L-14 (default) or -H-14, or one you registered")
    off.add_argument("--out", type=Path, required=True, help="export folder (created)")
    off.add_argument("--bert-vocab", help="folder holding vocab.txt, when the HuggingFace hub is not reachable")
    off.add_argument("--no-verify", action="store_true", help="skip reloading the export through open_clip")
    return parser


def main(argv=None) -> int:
    """Run `crate-clip convert ...`; returns the exit code."""
    args = build_parser().parse_args(argv)
    try:
        tokenizer = clip_tokenizer(args.model, bert_vocab=args.bert_vocab)  # fail before the slow part
        model = load_official_clipa(args.checkpoint, args.model)
        state = model.state_dict()
        export_open_clip(state, args.model, args.out, image_size=model.visual.image_size[0],
                         context_length=model.context_length, bert_vocab=args.bert_vocab)
    except USER_ERRORS as err:   # the checkpoint, the tokenizer's vocabulary, the output folder
        return report_error("crate-clip convert", err)
    print(f"wrote {args.out} ({sum(v.numel() for v in state.values()):,} values, tokenizer "
          f"{type(tokenizer).__name__}); load it with open_clip.create_model_and_transforms("
          f"'local-dir:{args.out}') after `import crate_clip`")
    if not args.no_verify:
        reloaded, _, _ = load_export(args.out)
        if not export_state_equal(reloaded, state):
            print("crate-clip convert: error: the export reloaded through open_clip differs", file=sys.stderr)
            return 1
        print("verified: open_clip reloads the export with identical weights")
    return 0


if __name__ == "__main__":
    sys.exit(main())
