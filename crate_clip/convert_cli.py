"""`crate-clip convert official CHECKPOINT --model NAME --out DIR`: a released CRATE-alpha-CLIPA `.pth` as an
open_clip `local-dir:` export (safetensors, open_clip_config.json with the model's preprocessing, and the
tokenizer files), which plain open_clip loads after `import crate_clip`."""
import argparse
import sys
from pathlib import Path

from crate_clip.checkpoint_io.trust_flag import TRUST_FLAG, TRUST_HELP, TRUST_WARNING
from crate_clip.core.cli_conventions import CommandParser, add_json_flag, chatter_to_stderr, print_json_result
from crate_clip.core.errors import USER_ERRORS, UserError, report_error
from crate_clip.core.writable_folders import check_writable


def build_parser() -> argparse.ArgumentParser:
    """The `crate-clip convert` argument parser."""
    parser = CommandParser(prog="crate-clip convert", description=" ".join(__doc__.split()))
    sub = parser.add_subparsers(dest="command", required=True)
    off = sub.add_parser("official", help="a released crate_alpha_CLIPA_{L14,H14}.pth (UCSC-VLAA/CRATE-alpha)")
    off.add_argument("checkpoint", type=Path, help="the .pth file (a plain state dict, read with weights_only=True)")
    off.add_argument("--model", default="CRATE-alpha-CLIPA-L-14",
                     help="open_clip config name: CRATE-alpha-CLIPA-L-14 (default) or -H-14, or one you registered")
    off.add_argument("--out", type=Path, required=True, help="export folder (created)")
    off.add_argument("--bert-vocab", help="folder holding vocab.txt, when the HuggingFace hub is not reachable")
    off.add_argument("--no-verify", action="store_true", help="skip reloading the export through open_clip")
    off.add_argument(TRUST_FLAG, dest="trust_checkpoint", action="store_true", help=TRUST_HELP)
    add_json_flag(off, "what was written (folder, model, values, tokenizer)")
    return parser


def check_model_name(name: str) -> None:
    """ValueError listing the known CRATE-alpha configs when `name` is no registered open_clip config."""
    import open_clip

    if open_clip.get_model_config(name) is None:
        known = [m for m in open_clip.list_models() if m.startswith("CRATE-alpha")]
        raise ValueError(f"--model {name}: no such open_clip model config; known CRATE-alpha models: "
                         f"{', '.join(known)} (or add your own config with open_clip.add_model_config first)")


class MissingCheckpointError(UserError, FileNotFoundError):
    """The .pth to convert is not a file; the message names it."""


def check_checkpoint_file(path: Path) -> None:
    """MissingCheckpointError naming `path` unless it is a file: said at once, not after the tokenizer's hub
    retries."""
    if not path.is_file():
        what = "is a folder, not a .pth file" if path.is_dir() else "does not exist"
        raise MissingCheckpointError(f"{path}: {what}; fix: pass the released crate_alpha_CLIPA_*.pth file")


def main(argv=None) -> int:
    """Run `crate-clip convert ...`; returns the exit code."""
    args = build_parser().parse_args(argv)
    # torch, open_clip and the models after parsing (seconds of CPU), so that --help is instant
    from crate_clip.checkpoint_io.safe_unpickling import trusted_checkpoints
    from crate_clip.export.writer import check_out_dir, export_open_clip, verify_export
    from crate_clip.models import clip_tokenizer, load_official_clipa

    try:
        check_model_name(args.model)
        check_out_dir(args.out)   # fail before the slow part
        check_writable(args.out, "--out")
        check_checkpoint_file(args.checkpoint)   # before the tokenizer, which may retry the hub for a minute
        tokenizer = clip_tokenizer(args.model, bert_vocab=args.bert_vocab)
        if args.trust_checkpoint:
            print(TRUST_WARNING, file=sys.stderr)
        with trusted_checkpoints(args.trust_checkpoint), chatter_to_stderr(args.json):   # stdout: the result alone
            model = load_official_clipa(args.checkpoint, args.model)
            state = model.state_dict()
            export_open_clip(state, args.model, args.out, image_size=model.visual.image_size[0],
                             context_length=model.context_length, bert_vocab=args.bert_vocab)
    except (*USER_ERRORS, FileExistsError) as err:   # the checkpoint, the tokenizer's vocabulary, the output folder
        return report_error("crate-clip convert", err)
    values = sum(v.numel() for v in state.values())
    verify = None if args.no_verify else (lambda: verify_export(args.out, state, "crate-clip convert"))
    if args.json:
        return print_json_result({"out": str(args.out), "model": args.model, "values": values,
                                  "tokenizer": type(tokenizer).__name__, "load": f"local-dir:{args.out}"}, verify)
    print(f"wrote {args.out} ({values:,} values, tokenizer {type(tokenizer).__name__}); load it with "
          f"open_clip.create_model_and_transforms('local-dir:{args.out}') after `import crate_clip`")
    return verify() if verify else 0


if __name__ == "__main__":
    sys.exit(main())
