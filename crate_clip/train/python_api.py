"""The Python API of training: `crate_clip.train.run(config) -> RunResult`, `crate-clip train` in the calling process.

    import crate_clip.train
    result = crate_clip.train.run("configs/demo/fashion_mnist.yaml", overrides=["stages.0.samples=6400"])
    result.run_dir, result.export_dir, [(r.stage_name, r.image_size, r.results["top1"]) for r in result.stage_results]

The config is a YAML path, a dict of the same keys, or a RunConfig (crate_clip.train.run.run_config); each goes
through the checks `crate-clip train` makes (launch_checks.checked_config), and the run through the same trainer.
Each exit reason of the command (docs/exit_codes.md) is an exception instead of an exit code: a UserError
(crate_clip.core.errors) whose `exit_code` is that code, of the class docs/python_api.md lists for it. Nothing of the
process is left changed for the next cell of a notebook: the save signals' handlers and mask, the environment
variables of the process group, the process group itself, the random generators, Python's warning filters and
DeepSpeed's logger are as they were (tests/test_train_python_api.py checks each).
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import random
import traceback
import warnings
from pathlib import Path
from typing import Iterator, Optional, Sequence, Union

import numpy as np
import torch
import torch.distributed as tdist

from crate_clip.checkpoint_io.bounded_reads import read_small_jsonl
from crate_clip.checkpoint_io.run_layout import RESULTS_FILE
from crate_clip.checkpoint_io.safe_unpickling import UntrustedCheckpointError, trusted_checkpoints
from crate_clip.checkpoint_io.write_failures import is_no_space
from crate_clip.core.errors import EXIT_PREEMPTED, EXIT_SOURCE_UNAVAILABLE, USER_ERRORS, UserError
from crate_clip.core.writable_folders import unwritable_error
from crate_clip.train.loop import stop_requests
from crate_clip.train.loop.stage_evals import EvalRecord
from crate_clip.train.loop.stage_loop import run_training
from crate_clip.train.reporting.deepspeed_output import deepspeed_logs_diverted, stop_diverting_deepspeed_logs
from crate_clip.train.run.disk_space import no_space_while_writing
from crate_clip.train.run.launch_checks import checked_config
from crate_clip.train.run.launcher_watch import watch_launcher
from crate_clip.train.run.run_config import RunConfig, apply_override, config_from_dict
from crate_clip.train.run.save_signals import DEFAULT_SIGNALS, held_until_handled, parse_signals

ConfigLike = Union[str, os.PathLike, dict, RunConfig]


@dataclasses.dataclass(frozen=True)
class RunResult:
    """A finished run: its folder, what each stage scored and where its open_clip export is."""
    run_dir: Path                           # absolute, as the paths below
    stage_results: tuple[EvalRecord, ...]   # results.jsonl at each stage's end, in order: the last row per
                                            # (stage, evaluation, image size, resize); mid-stage rows left out
    export_dir: Optional[Path]              # the open_clip `local-dir:` folder; None on ranks other than 0
    last_checkpoint: Optional[Path]
    samples_seen: int
    global_step: int
    seconds: float                          # this call's training time (a resume: since it resumed)

    def results_of(self, stage: int) -> list[EvalRecord]:
        """The evaluations of stage `stage` (an index; -1: the last stage)."""
        indices = sorted({r.stage_index for r in self.stage_results})
        index = indices[stage] if stage < 0 and len(indices) >= -stage else stage
        return [r for r in self.stage_results if r.stage_index == index]


class SourceUnavailableStop(stop_requests.StopRequested):
    """Exit code 7: a remote data source stayed unreachable past data.remote_retry_total_s; the last completed step is
    saved and `resume="latest"` continues once the source is back."""

    def __init__(self, message: str, exit_code: int = EXIT_SOURCE_UNAVAILABLE):
        super().__init__(message, exit_code)


class PreemptedStop(stop_requests.StopRequested):
    """Exit code 8: stopped by a save signal (`save_on_signal`, default SIGUSR1 and SIGTERM) after saving the step
    in progress; `resume="latest"` continues."""

    def __init__(self, message: str, exit_code: int = EXIT_PREEMPTED):
        super().__init__(message, exit_code)


class InputError(UserError, ValueError):
    """Exit code 2 for an input a library refused with a plain ValueError, FileNotFoundError or NotADirectoryError
    (the command reports these as its exit 2 too); the library's exception is its __cause__."""


_STOPS = {EXIT_SOURCE_UNAVAILABLE: SourceUnavailableStop, EXIT_PREEMPTED: PreemptedStop}


def run(config: ConfigLike, *, overrides: Sequence[str] = (), resume: Optional[str] = None, overwrite: bool = False,
        allow_changes: Sequence[str] = (), take_over_lock: bool = False, trust_checkpoint: bool = False,
        save_on_signal: str = DEFAULT_SIGNALS) -> RunResult:
    """Train `config` in this process, as `crate-clip train` would, and return the finished run.

    `config`: a YAML path, a dict or a RunConfig; `overrides`: `--set` assignments ("stages.0.lr=1e-3"); the
    keywords are the command's options of the same names (`resume`: "latest", "auto" or a checkpoint folder;
    `save_on_signal`: "USR1,TERM" or "none"). Raises the UserError of each exit reason (docs/python_api.md)."""
    try:
        stop_signals = parse_signals(save_on_signal)
    except ValueError as exc:
        raise InputError(str(exc).replace("--save-on-signal", "save_on_signal")) from None
    with held_until_handled(stop_signals), process_state_kept():
        watch_launcher()   # under torchrun / deepspeed / accelerate launch: stop when the launcher is gone
        for old_name in ("all_gather_into_tensor", "torch.distributed.nn.functional.all_gather"):   # as the CLI
            warnings.filterwarnings("ignore", message=f".*{old_name}.* is deprecated", category=FutureWarning)
        cfg = checked_config(*_config_source(config, list(overrides)), world_size=int(os.environ.get("WORLD_SIZE", 1)),
                             overwrite=overwrite, resume=resume)
        summary = _train(cfg, resume, overwrite, take_over_lock, tuple(allow_changes), trust_checkpoint, stop_signals)
    return RunResult(run_dir=cfg.run_dir.absolute(), stage_results=stage_results(cfg.run_dir),
                     export_dir=Path(summary["export_dir"]).absolute() if summary.get("export_dir") else None,
                     last_checkpoint=Path(summary["last_checkpoint"]).absolute()
                     if summary.get("last_checkpoint") not in (None, "None") else None,   # str(None): nothing trained
                     samples_seen=summary["progress"]["samples_seen"], global_step=summary["progress"]["global_step"],
                     seconds=summary["seconds"])


def _config_source(config: ConfigLike, overrides: list[str]) -> tuple[Union[str, os.PathLike, RunConfig], list[str]]:
    """What checked_config takes: a path with its overrides as they are, or a RunConfig built from the dict (or from
    the RunConfig's own values, so that it is validated again: a field assigned after loading is checked too) with the
    overrides applied."""
    if isinstance(config, (str, os.PathLike)):
        return config, overrides
    if isinstance(config, RunConfig):
        raw, source = config.to_dict(), config.source_path
    elif isinstance(config, dict):
        raw, source = copy.deepcopy(config), None
    else:
        raise InputError(f"config: a YAML path, a dict or a RunConfig, not {type(config).__name__}")
    for assignment in overrides:
        apply_override(raw, assignment)
    base_dir = Path(source).parent if source else Path(".")
    return config_from_dict(raw, base_dir=base_dir, check_paths=False, source_path=source), []


def _train(cfg: RunConfig, resume: Optional[str], overwrite: bool, take_over_lock: bool, allow_changes: tuple,
           trust_checkpoint: bool, stop_signals: tuple[int, ...]) -> dict:
    """run_training under the command's stop handling; each failure the command reports as an exit code raised as
    the UserError carrying it (crate_clip/train/cli.py's `_train` maps the same ones)."""
    created_group = not (tdist.is_available() and tdist.is_initialized())
    try:
        with trusted_checkpoints(trust_checkpoint), stop_requests.stop_signals_handled(stop_signals):
            return run_training(cfg, resume=resume, overwrite=overwrite, take_over_lock=take_over_lock,
                                allow_changes=allow_changes)
    except stop_requests.StopRequested as exc:   # saved, the run folder's lock released
        stop = _STOPS.get(exc.exit_code)
        if stop is None or isinstance(exc, stop):
            raise _released(exc)
        raise _released(stop(str(exc)).with_traceback(exc.__traceback__), exc) from None
    except UserError as exc:
        raise _released(exc)
    except (UntrustedCheckpointError, *USER_ERRORS) as exc:
        raise _released(InputError(" ".join(str(exc).split()) or type(exc).__name__), exc) from exc
    except Exception as exc:   # a full disk outside a checkpoint save, a read-only file system
        error = no_space_while_writing(exc, cfg.run_dir) if is_no_space(exc) else \
            unwritable_error(exc, cfg.run_dir, "run.output_dir")
        if error is None:
            raise   # an unexpected error (the command's exit 1): its frames kept, for a debugger
        raise _released(error, exc) from exc
    finally:
        if created_group and tdist.is_available() and tdist.is_initialized():
            _destroy_process_group()


def _destroy_process_group() -> None:
    """The run's process group gone, and DeepSpeed's references to its groups with it: torch's destroy alone leaves
    them cached, and the next run in this process would broadcast over a group that is no longer registered."""
    import deepspeed.comm   # imported by the run (stage_setup/engine.py) when it made the group

    if deepspeed.comm.is_initialized():
        deepspeed.comm.destroy_process_group()
    else:
        tdist.destroy_process_group()


def _released(error: UserError, *raised: BaseException) -> UserError:
    """`error`, with the locals of the trainer's frames it (and `raised`, which it replaces) went through let go: a
    notebook keeps the last exception (sys.last_value), and its traceback would otherwise hold the run's engine and
    model (GPU memory) and the data stream's DataLoader workers (processes) until the next error. The traceback's
    lines stay."""
    for exc in (error, *raised):
        traceback.clear_frames(exc.__traceback__)
    return error


def stage_results(run_dir: Path) -> tuple[EvalRecord, ...]:
    """The results.jsonl rows of `run_dir` taken at a stage's end, the last one per (stage, evaluation, image size,
    resize, weights: live or train.ema's), in stage order, as EvalRecords."""
    names = [f.name for f in dataclasses.fields(EvalRecord) if f.name != "results"]
    rows = {}
    for _, row in read_small_jsonl(Path(run_dir) / RESULTS_FILE):   # bounded, as the export reads it
        if isinstance(row, dict) and row.get("at", "stage_end") == "stage_end" and type(row.get("stage_index")) is int:
            row = {"resize": "grid", "at": "stage_end", "weights": "live", **row}   # rows without these keys
            rows[(row["stage_index"], str(row.get("eval")), row.get("image_size") or 0, row["resize"],
                  str(row["weights"]))] = row
    return tuple(EvalRecord(**{k: row.get(k) for k in names}, results={k: v for k, v in row.items() if k not in names})
                 for _, row in sorted(rows.items(), key=lambda item: item[0]))


_PROCESS_GROUP_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@contextlib.contextmanager
def process_state_kept() -> Iterator[None]:
    """For the body (a training run in this process): afterwards the environment variables a world of one sets
    (stage_setup/engine.init_distributed), the random generators the run seeds, Python's warning filters and
    DeepSpeed's logger are as before, so a notebook's next cell (or a next run) starts from what it had."""
    env = {name: os.environ.get(name) for name in _PROCESS_GROUP_ENV}
    diverted = deepspeed_logs_diverted()   # by an earlier run in this process (crate-clip train called in it)
    generators = (random.getstate(), np.random.get_state(), torch.get_rng_state(),
                  torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None)
    try:
        with warnings.catch_warnings():   # the filters set here, and showwarning (a rank other than 0 diverts it)
            yield
    finally:
        for name, value in env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        random.setstate(generators[0])
        np.random.set_state(generators[1])
        torch.set_rng_state(generators[2])
        if generators[3] is not None:
            torch.cuda.set_rng_state_all(generators[3])
        if not diverted:
            stop_diverting_deepspeed_logs()
