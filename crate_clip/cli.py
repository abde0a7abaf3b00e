"""The `crate-clip` command: dispatches to the sub-commands in SUBCOMMANDS (train, eval, export, shards, ...)."""
import errno
import importlib
import sys

from crate_clip.core.cli_conventions import did_you_mean
from crate_clip.core.errors import USER_ERRORS, pop_debug_flag, report_error, show_exit_code
from crate_clip.core.writable_folders import unwritable_error

# sub-command -> module whose main(argv) runs it; imported lazily so `crate-clip shards` does not pay
# for DeepSpeed's import, and so the packages keep their one direction of imports.
SUBCOMMANDS = {
    "train": ("crate_clip.train.cli", "train a CRATE-alpha CLIP from a run config (YAML)"),
    "eval": ("crate_clip.eval.cli", "zero-shot classification, retrieval and linear-probe evaluation"),
    "shards": ("crate_clip.data.cli", "write DataComp-layout webdataset shards from local data"),
    "plan": ("crate_clip.train.plan_cli", "per-stage memory fit, micro-batch, FLOPs and GPU-hours of a run config"),
    "demo": ("crate_clip.train.demo", "the embedded Fashion-MNIST demo (the README's first command)"),
    "inspect": ("crate_clip.eval.inspect_cli", "white-box maps (attention per head, PCA) and a caption's attention and atoms"),
    "segment": ("crate_clip.eval.segment_cli", "zero-shot segmentation (MaskCut) as PNG overlays + COCO RLE JSON"),
    "convert": ("crate_clip.convert_cli", "released CRATE-alpha-CLIPA weights -> an open_clip local-dir: export"),
    "export": ("crate_clip.export.cli", "a training checkpoint -> an open_clip local-dir: / hf-hub: folder"),
    "models": ("crate_clip.models_cli", "the registered model configs with their parameters and FLOPs"),
}


def _usage() -> str:
    lines = ["usage: crate-clip [--debug] [--version] <command> [options]   (crate-clip <command> --help: its options)",
             "", "commands:"]
    lines += [f"  {name:<8}{help_}" for name, (_, help_) in SUBCOMMANDS.items()]
    return "\n".join(lines)


def main(argv=None) -> int:
    """Run `crate-clip <command> ...`."""
    argv = pop_debug_flag(list(sys.argv[1:] if argv is None else argv))
    if argv and argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    if not argv:   # argparse's convention, as every sub-command without its arguments: usage on stderr, exit 2
        print(f"{_usage()}\n\ncrate-clip: error: the following arguments are required: <command>", file=sys.stderr)
        return 2
    if argv[0] in ("-V", "--version"):
        from crate_clip import __version__
        print(f"crate-clip {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"crate-clip: unknown command {name!r}{did_you_mean(name, SUBCOMMANDS)}\n\n{_usage()}", file=sys.stderr)
        return 2
    try:
        module = importlib.import_module(SUBCOMMANDS[name][0])
        code = int(module.main(rest) or 0)
    except USER_ERRORS as exc:   # one line naming the file/key and the fix; --debug shows the traceback
        code = report_error(f"crate-clip {name}", exc)
    except SystemExit as exc:   # argparse's usage errors
        show_exit_code(exc.code if isinstance(exc.code, int) else 1)
        raise
    except OSError as exc:   # a read-only file system met while writing (the commands check first): one line, 2
        unwritable = unwritable_error(exc, exc.filename or "a file", "path", errnos=(errno.EROFS,))
        if unwritable is None:
            raise
        code = report_error(f"crate-clip {name}", unwritable)
    return show_exit_code(code)


if __name__ == "__main__":
    sys.exit(main())
