"""`crate-clip export CHECKPOINT [--stage N] [--out DIR] [--hub-id ORG/NAME]`: any training checkpoint as an
open_clip model folder (`local-dir:`, and the Hugging Face Hub layout for `hf upload`), without
training further. The trainer's final export is this command on the run's last checkpoint.
"""
from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

from crate_clip.checkpoint_io.trust_flag import TRUST_FLAG, TRUST_HELP, TRUST_WARNING
from crate_clip.core.cli_conventions import CommandParser, add_json_flag, chatter_to_stderr, print_json_result


def build_parser() -> argparse.ArgumentParser:
    """The `crate-clip export` argument parser."""
    p = CommandParser(prog="crate-clip export", description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("checkpoint", type=Path,
                   help="a run folder, its checkpoints/ folder (the checkpoint `latest` names), or one checkpoint "
                        "folder such as runs/x/checkpoints/stage0-step00001000")
    p.add_argument("--stage", type=int, default=None, help="export that stage's last checkpoint instead")
    p.add_argument("--weights", choices=("live", "ema"), default="live",
                   help="live: the trained weights (default); ema: their exponential moving average that a run with "
                        "train.ema kept (in the checkpoint), written to <run folder>/exports/<tag>-ema by default")
    p.add_argument("--out", type=Path, default=None,
                   help="export folder (default: <run folder>/exports/<checkpoint tag>, -ema after it for "
                        "--weights ema); an earlier export there is replaced")
    p.add_argument("--hub-id", default=None, metavar="ORG/NAME",
                   help="the Hugging Face repository the folder will be uploaded to: the model card's snippet "
                        "names it, and a HuggingFace tokenizer (CLIPA's BERT) is read from it by hf-hub:ORG/NAME")
    p.add_argument("--repo-url", default=None, metavar="URL",
                   help="the code repository the model card links (default: setup.cfg's url, if it names one)")
    p.add_argument("--bert-vocab", default=None,
                   help="folder holding the run's vocab.txt, when the one the run recorded has moved")
    p.add_argument("--no-verify", action="store_true", help="skip reloading the export through open_clip")
    p.add_argument(TRUST_FLAG, dest="trust_checkpoint", action="store_true", help=TRUST_HELP)
    add_json_flag(p, "what was written (folder, checkpoint, stage, step, image size)")
    return p


@contextlib.contextmanager
def phase(what: str):
    """One plain progress line as each phase ends (on a terminal or not), on stderr (stdout holds the result):
    consolidating a large model's ZeRO shards takes minutes (the reload check's line is its verdict). Said at the
    end, so that a refusal inside a phase (a damaged or unsafe checkpoint) stays the command's one line."""
    t0 = time.perf_counter()
    yield
    print(f"crate-clip export: {what} in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)


def main(argv=None) -> int:
    """Run `crate-clip export`; returns the exit code."""
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    import crate_clip  # noqa: F401  (registers the model configs the checkpoint names)
    from crate_clip.checkpoint_io.deepspeed_checkpoints import consolidated_state_dict
    from crate_clip.checkpoint_io.ema_state import required_ema_state, with_ema
    from crate_clip.checkpoint_io.safe_unpickling import trusted_checkpoints
    from crate_clip.core.errors import USER_ERRORS, report_error
    from crate_clip.core.writable_folders import check_writable
    from crate_clip.checkpoint_io.run_layout import checkpoint_export_dir
    from crate_clip.models import TokenizerUnavailableError
    from crate_clip.export.writer import check_out_dir, export_checkpoint, verify_export
    from crate_clip.export.source import export_source

    try:
        if args.out is not None:   # a read-only --out: said before the checkpoint is read
            check_writable(args.out, "--out")
        source = export_source(args.checkpoint, args.stage, args.bert_vocab, args.weights)
        ema = args.weights == "ema"
        out = args.out or checkpoint_export_dir(source.tag_dir, ema)
        check_out_dir(out)   # before the consolidation, which takes minutes for a large model
        check_writable(out, "--out")
        if args.trust_checkpoint:
            print(TRUST_WARNING, file=sys.stderr)
        # DeepSpeed's consolidation talks on stdout: with --json, stdout holds the result alone
        with phase(f"read {source.tag_dir} (its ZeRO shards consolidated to fp32 weights)"), \
                trusted_checkpoints(args.trust_checkpoint), chatter_to_stderr(args.json):
            averages = required_ema_state(source.tag_dir) if ema else None   # refused before the consolidation
            state = consolidated_state_dict(source.tag_dir)
            state = with_ema(state, averages) if ema else state
        with phase(f"wrote the weights, open_clip config, tokenizer and model card to {out}"):
            export_checkpoint(source.tag_dir, out, state=state, bert_vocab=args.bert_vocab, hub_id=args.hub_id,
                              repo_url=args.repo_url, weights=args.weights)
    except (*USER_ERRORS, TokenizerUnavailableError, FileExistsError) as err:   # one line naming the fix
        return report_error("crate-clip export", err)
    verify = None if args.no_verify else (lambda: verify_export(out, state, "crate-clip export"))
    progress = source.record.progress
    if args.json:
        return print_json_result({"out": str(out), "checkpoint": str(source.tag_dir), "load": f"local-dir:{out}",
                                  "stage": progress.stage_index, "step": progress.step,
                                  "image_size": source.image_size, **({"weights": "ema"} if ema else {})}, verify)
    print(f"wrote {out} from {source.tag_dir}{' (its EMA weights)' if ema else ''} (stage {progress.stage_index}, "
          f"step {progress.step}, {source.image_size} px); load it with open_clip.create_model_and_transforms("
          f"'local-dir:{out}') after `import crate_clip`")
    return verify() if verify else 0


if __name__ == "__main__":
    sys.exit(main())
