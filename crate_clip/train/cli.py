"""`crate-clip train --config X [--set a.b=v ...] [--resume latest|auto|PATH]`: one entry for every launcher.

Runs as it is in one process, or under `deepspeed`, `torchrun` or `accelerate launch` (they set RANK,
WORLD_SIZE, MASTER_ADDR; the DeepSpeed launcher also passes --local_rank, accepted and ignored here).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

from crate_clip.checkpoint_io.trust_flag import TRUST_FLAG, TRUST_HELP
from crate_clip.core.cli_conventions import CommandParser, add_json_flag, chatter_to_stderr
from crate_clip.core.cli_numbers import POSITIVE_INT


PROG = "crate-clip train"


def build_parser() -> argparse.ArgumentParser:
    """The `crate-clip train` argument parser."""
    p = CommandParser(prog=PROG, description="Train a CRATE-alpha CLIP from a run config.",
                      epilog="Every run-config key, its type, default and meaning: docs/config.md; how a "
                             "run uses them: docs/training.md.")
    p.add_argument("config", nargs="?", default=None, metavar="CONFIG",
                   help="run config YAML (see configs/ and docs/config.md), as `crate-clip plan CONFIG` takes it")
    p.add_argument("--config", dest="config_option", default=None, metavar="CONFIG",
                   help="the run config YAML (same as the positional; the form launchers' docs use)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set stages.0.lr=1e-3 (repeatable)")
    p.add_argument("--resume", default=None, metavar="latest|auto|PATH",
                   help="continue from the newest complete checkpoint of the run, or from a checkpoint folder; auto: "
                        "the newest complete checkpoint if there is one, else start (for restarts and requeues)")
    p.add_argument("--allow-change", dest="allow_changes", action="append", default=[], metavar="KEY",
                   help="with --resume: let the run config change KEY (e.g. stages.1.lr; a section names all its "
                        "keys) of what the run trains; recorded in the run folder's config_changes.jsonl; other "
                        "changes to what is trained are refused (repeatable; docs/training.md, \"Changing the config "
                        "of a run\")")
    p.add_argument("--overwrite", action="store_true",
                   help="run.output_dir holds an earlier run: move it to <output_dir>.previous and start over")
    p.add_argument("--take-over-lock", action="store_true",
                   help="take over the run folder's lock even though another host still refreshes it (that run is "
                        "gone: its node was lost or its job cancelled); a running process of this host still refuses")
    p.add_argument("--save-on-signal", default="USR1,TERM", metavar="SIGNALS",
                   help="signals that make every rank finish its step, save a checkpoint, release the run folder and "
                        "exit 8 (Slurm: --signal=B:USR1@120, and the SIGTERM of scancel, preemption and requeue); "
                        "comma-separated, or none (default: USR1,TERM; docs/training.md#preemption-and-slurm)")
    p.add_argument("--requeue", action=argparse.BooleanOptionalAction, default=False,
                   help="after such a stop, or when the job ends for a lost rank (exit 9), requeue this Slurm "
                        "job (scontrol requeue $SLURM_JOB_ID) unless Slurm is "
                        "already ending it: it resumes with --resume auto (--no-requeue: the last one given wins)")
    p.add_argument(TRUST_FLAG, dest="trust_checkpoint", action="store_true", help=TRUST_HELP)
    p.add_argument("--validate", action="store_true",
                   help="check the config, print the shell commands its pipe: sources run, and exit")
    add_json_flag(p, "the result (with --validate: the checked plan; after training: the run's summary, from rank "
                     "0; every other line on stderr)")
    p.add_argument("--nproc", type=POSITIVE_INT, default=None, metavar="N",
                   help="start N training processes on this host (torch's elastic launcher, as torchrun) after "
                        "checking everything that can be checked before they start; exits with their own exit code")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return p


def main(argv=None) -> int:
    """Run `crate-clip train`; returns the exit code."""
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    if (args.config is None) == (args.config_option is None):
        parser.error("give the run config once: `crate-clip train CONFIG` or `crate-clip train --config CONFIG`")
    args.config = args.config or args.config_option
    if args.nproc and os.environ.get("RANK") is not None:
        parser.error("--nproc starts the training processes itself; under torchrun, deepspeed or accelerate launch "
                     "leave it out (the launcher's process count is used)")
    from crate_clip.train.run.save_signals import held_until_handled, parse_signals

    try:
        stop_signals = parse_signals(args.save_on_signal)
    except ValueError as exc:
        parser.error(str(exc))
    # a training process or a launcher: a save signal from now on is a stop, never an end
    with held_until_handled(() if args.validate else stop_signals):
        return _train(args, argv, stop_signals)


def _train(args, argv: list[str], stop_signals: tuple[int, ...]) -> int:
    """`crate-clip train` once its command line is read: check, launch or run, and the exit code."""
    # the run's modules (torch, DeepSpeed, open_clip: seconds of CPU) after parsing, so that --help is instant
    import torch.distributed as tdist

    from crate_clip.train.loop import stop_requests

    from crate_clip.checkpoint_io.safe_unpickling import UntrustedCheckpointError, trusted_checkpoints
    from crate_clip.checkpoint_io.write_failures import is_no_space
    from crate_clip.core.errors import USER_ERRORS, ConfigError, report_error
    from crate_clip.core.shard_sources import shell_commands
    from crate_clip.core.writable_folders import unwritable_error
    from crate_clip.train.run.disk_space import no_space_while_writing
    from crate_clip.train.run.launcher_watch import watch_launcher
    from crate_clip.train.checkpointing.config_changes import config_changes
    from crate_clip.train.run.launch_checks import checked_config
    from crate_clip.checkpoint_io.checkpoint_choice import RESUME, choose_checkpoint
    from crate_clip.checkpoint_io.run_layout import checkpoints_dir
    from crate_clip.train.checkpointing.checkpoints import ResumeError
    from crate_clip.train.run.run_lock import RunLockedError

    watch_launcher()   # under torchrun / deepspeed / accelerate: stop when the launcher is gone
    # DeepSpeed 0.19 and open_clip's ClipLoss (gather_with_grad) still call torch collectives under their old
    # names: torch's deprecation notices (one per rank and collective) say nothing a user can act on
    for old_name in ("all_gather_into_tensor", "torch.distributed.nn.functional.all_gather"):
        warnings.filterwarnings("ignore", message=f".*{old_name}.* is deprecated", category=FutureWarning)
    try:
        # the launching process (--nproc, --validate) checks all it can before any worker starts, data and the
        # output folder included, so that a refusal is said once (pipe: commands run only for a launch:
        # --validate is how a config from elsewhere is read safely); a worker checks the same but the lock
        launch, launching = bool(args.nproc and not args.validate), bool(args.validate or args.nproc)
        cfg = checked_config(args.config, args.overrides, world_size=args.nproc or int(os.environ.get("WORLD_SIZE", 1)),
                             device=_launch_device() if launch else None, overwrite=args.overwrite,
                             resume=args.resume, take_over_lock=args.take_over_lock if launching else None,
                             probe=launching, run_commands=launch)
        if args.resume and launching:   # a resume that changes what the run trains, unnamed:
            config_changes(cfg, args.resume, args.allow_changes)   # refused before any worker starts
        if args.validate and args.resume not in (None, "auto"):   # what it names is there (the run's exit 4)
            choose_checkpoint(args.resume, RESUME, run_checkpoints=checkpoints_dir(cfg.run_dir), error=ResumeError)
    except (ConfigError, RunLockedError, ResumeError) as exc:   # every rank of a launched job finds it: rank 0 says it
        return report_error(PROG, exc, once_per_job=True)
    if args.validate and args.json:
        print(json.dumps({"config": args.config, "valid": True, "stages": len(cfg.stages),
                          "steps": sum(s.steps for s in cfg.stages),
                          "samples": sum(s.trained_samples for s in cfg.stages), "plan": cfg.training_plan(),
                          "shell_commands": shell_commands(cfg.data.sources)}, indent=1))
        return 0
    if args.validate:
        print(f"{args.config}: valid ({len(cfg.stages)} stages, {sum(s.steps for s in cfg.stages):,} steps, "
              f"{sum(s.trained_samples for s in cfg.stages):,} samples)")
        print("\n".join(f"  {line}" for line in cfg.training_plan()))
        commands = shell_commands(cfg.data.sources)
        if commands:   # a run config is as trusted as a script: say what it will run
            print("shell commands this run executes (pipe: sources; a run config is as trusted as a script, "
                  "see docs/safety.md):\n" + "\n".join(f"  {line}" for line in commands))
        return 0
    if args.nproc:   # the workers' own exit code, not torchrun's 1 (crate_clip/train/worker_launch.py)
        from crate_clip.train.worker_launch import run_workers, torchrun_args

        return run_workers(torchrun_args(args.nproc, _without_nproc(argv)))
    # the training loop imports the model stack (timm, open_clip, DeepSpeed: seconds): a launcher does not
    from crate_clip.train.loop.stage_loop import run_training

    try:
        # after a stop the save signals are ignored: a second one cannot cut the requeue or the exit short
        with trusted_checkpoints(args.trust_checkpoint), \
                stop_requests.stop_signals_handled(stop_signals, ignore_after_stop=True,
                                                   requeue_when_lost=args.requeue), \
                chatter_to_stderr(args.json):   # --json: stdout keeps the summary alone
            summary = run_training(cfg, resume=args.resume, overwrite=args.overwrite,
                                   take_over_lock=args.take_over_lock, allow_changes=tuple(args.allow_changes))
    except UntrustedCheckpointError as exc:   # every rank reads the same files: rank 0 says it
        return report_error(PROG, exc, once_per_job=True)
    except stop_requests.StopRequested as exc:   # saved, and the run folder's lock released
        code = report_error(PROG, exc)
        if args.requeue and os.environ.get("RANK", "0") == "0":
            stop_requests.requeue_slurm_job()
        return code
    except USER_ERRORS as exc:   # config, run folder, resume, non-finite losses: a message and their exit code
        return report_error(PROG, exc)
    except Exception as exc:   # a full disk outside a checkpoint save (metrics, run_config.yaml, the export)
        if is_no_space(exc):
            return report_error(PROG, no_space_while_writing(exc, cfg.run_dir))
        unwritable = unwritable_error(exc, cfg.run_dir, "run.output_dir")   # a read-only file system
        if unwritable is None:
            raise
        return report_error(PROG, unwritable, once_per_job=True)
    finally:
        if tdist.is_available() and tdist.is_initialized():
            tdist.destroy_process_group()
    if summary.get("export_dir") and args.json:   # rank 0's summary (the other ranks have no export)
        print(json.dumps(summary, indent=1, default=str))
    elif summary.get("export_dir"):
        print(f"done in {summary['seconds']:.0f} s; export: {summary['export_dir']}")
    return 0


def _launch_device() -> str:
    """The device the launched workers will train on (fp16 is refused on CPU)."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _without_nproc(argv: list[str]) -> list[str]:
    """The command line a launched worker gets: this one without --nproc N (a worker is one process)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--nproc":
            skip = True
        elif not arg.startswith("--nproc="):
            out.append(arg)
    return out


if __name__ == "__main__":   # `python -m crate_clip.train.cli`, what torchrun and the demo start
    from crate_clip.core.errors import show_exit_code

    sys.exit(show_exit_code(main()))
