"""Everything about a run that can be checked before any worker starts, in the process that launches them
(`crate-clip train --nproc N`, `crate-clip train --validate`, the demo): the config's keys (warm-up against the
stage's steps among them), the batches against the process count, the output folder (one that holds a run is
refused without --resume or --overwrite, --overwrite moves only a run, a live run's lock refuses a start), local
data and evaluation sets present, and each remote data source answering a short probe of its first shard. Every
problem is one line; all of them come at once in one ConfigError (exit code 2; then a live run's lock: the
launch's own RunLockedError, exit code 5), said once by the launching process, not by every worker after the
launcher started them, nor as a worker's traceback under the launcher's ChildFailedError minutes later.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

from crate_clip.core.errors import ConfigError
from crate_clip.core.shard_sources import PIPE, ShardListError, TooManyShardsError, expand_source, is_remote
from crate_clip.data.remote_transport import (COMMAND_SCHEMES, PermanentSourceError, TransientSourceError,
                                              open_transport, shown_source)
from crate_clip.train.run.run_config import (RunConfig, apply_override, batch_problem, load_run_config,
                                             path_problems, runtime_problems)
from crate_clip.train.run.run_dir import ExistingRunError, LinkedRunPartError, check_run_dir, output_dir_problems
from crate_clip.train.run.run_lock import RunLockedError, in_use_problem

PROBE_TIMEOUT_S = 10.0   # per remote source (or data.remote_stall_timeout_s when shorter): a server that answers
                         # at all answers a 512-byte read far sooner
PROBE_BYTES = 512        # one tar header: the first shard is there and sends data


def checked_config(path: str | Path | RunConfig, overrides: list[str], *, world_size: int,
                   device: Optional[str] = None, overwrite: bool = False, probe: bool = False,
                   resume: Optional[str] = None, take_over_lock: Optional[bool] = None,
                   run_commands: bool = False, data_written: bool = True) -> RunConfig:
    """The run config of `path` with `overrides`, checked for a launch of `world_size` processes; raises one
    ConfigError listing every problem found (`probe`: also ask each http(s) data source for its first shard, and
    with `run_commands` run each `pipe:` source's first command: only when the run is launched, never for
    `--validate`, which is how a config from elsewhere is read before it runs anything; `data_written` False: the
    data and evaluation sets are written later, by the demo, so not looked for).
    `resume`, `overwrite`: the command's (a folder holding a run is refused with neither); `take_over_lock`: None
    leaves the folder's lock to the run (a worker), else the command's --take-over-lock, and a live run holding
    the lock is refused now.
    `path` may be a RunConfig built
    already, its overrides applied (the Python API's dict or config object, crate_clip/train/python_api.py)."""
    if isinstance(path, RunConfig):
        cfg, path = path, path.source_path or "given in Python"
    else:
        try:
            cfg = load_run_config(path, overrides, check_paths=False)
        except ConfigError as exc:   # keys refused: add the batch lines the raw values already show
            extra = _raw_batch_problems(path, overrides, world_size)
            raise ConfigError("\n  ".join([str(exc), *extra])) from None
    base_dir = Path(cfg.source_path).parent if cfg.source_path else Path(".")
    problems = (path_problems(cfg, base_dir) if data_written else
                output_dir_problems(cfg.run.output_dir, cfg.data.sources, [e.data for e in cfg.eval.evals]))
    problems += runtime_problems(cfg, world_size, device)
    if not any(line.startswith("run.output_dir") for line in problems):   # one line about that folder is enough
        problems += _run_folder_problems(cfg.run_dir, resume, overwrite)
    if probe:
        timeout = min(PROBE_TIMEOUT_S, cfg.data.remote_stall_timeout_s)   # no longer than a run would wait
        problems += remote_source_problems(cfg.data.sources, timeout, run_commands=run_commands)
    if problems:   # as every config refusal: one line per problem under the header
        raise ConfigError(f"invalid run config ({path}):\n  " + "\n  ".join(problems))
    in_use = None if take_over_lock is None else in_use_problem(cfg.run_dir, take_over_lock)
    if in_use:   # the launch's own refusal, with its exit code (5)
        raise RunLockedError(in_use)
    return cfg


def _run_folder_problems(run_dir: Path, resume: Optional[str], overwrite: bool) -> list[str]:
    """What the run would refuse about its output folder (run_dir.check_run_dir): a run there without --resume
    or --overwrite, --overwrite of a folder of other files, a part linked out of it (raised as it is for a resume:
    its exit code is 4)."""
    try:
        check_run_dir(run_dir, resume, overwrite)
    except LinkedRunPartError as exc:
        if resume:
            raise
        return [str(exc)]
    except ExistingRunError as exc:
        return [str(exc)]
    return []


def _raw_batch_problems(path, overrides, world_size: int) -> list[str]:
    """The batch-against-processes lines of the stages whose batch keys are plain integers (best effort: the
    config's own error is what is reported when it cannot be read)."""
    try:
        from crate_clip.core.safe_yaml import load_yaml_file   # the bounded YAML reader load_run_config uses

        raw = load_yaml_file(Path(path)) or {}
        for assignment in overrides:
            apply_override(raw, assignment)
        stages = raw.get("stages") or []
    except Exception:   # noqa: BLE001 - already reported by load_run_config
        return []
    lines = []
    for i, stage in enumerate(stages if isinstance(stages, list) else []):
        batch = stage.get("global_batch") if isinstance(stage, dict) else None
        if type(batch) is int and batch >= 2:
            micro = stage.get("micro_batch")
            line = batch_problem(f"stages.{i}", batch, micro if type(micro) is int and micro >= 1 else None,
                                 world_size)
            lines += [line] if line else []
    return lines


def remote_source_problems(sources: list[str], timeout: float = PROBE_TIMEOUT_S,
                           run_commands: bool = False) -> list[str]:
    """One line per remote source whose first shard does not give its first bytes within `timeout` seconds. Read
    as training reads it (crate_clip.data.remote_transport): http(s) and hf:// always; sources read through a
    command (pipe:, gs://, ais://, sftp://) only with `run_commands`."""
    problems = []
    for i, source in enumerate(sources):
        if not is_remote(source) or (_runs_a_command(source) and not run_commands):
            continue
        try:
            shard = expand_source(source)[0]
        except (ShardListError, TooManyShardsError, IndexError):
            continue   # the config check names it
        error = probe_shard(shard, timeout)
        if error:
            problems.append(f"data.sources.{i}: the first shard {shown_source(shard)!r} cannot be read: {error}; fix: "
                            "check the server or the command (a run would retry it, then stop), or correct the source")
    return problems


def _runs_a_command(source: str) -> bool:
    return source.startswith(PIPE) or source.startswith(tuple(COMMAND_SCHEMES))


def probe_shard(shard: str, timeout: float = PROBE_TIMEOUT_S) -> Optional[str]:
    """Why the first PROBE_BYTES of a remote shard cannot be read within `timeout` seconds in all (a transfer that
    dribbles is cut off too); None when they can. The transfer is closed after them (a command: its whole
    process group is ended)."""
    deadline, received = time.monotonic() + timeout, 0
    buffer = bytearray(PROBE_BYTES)
    try:
        transfer = open_transport(shard, stall_s=timeout)
    except (TransientSourceError, PermanentSourceError) as exc:
        return str(exc)
    try:
        while received < PROBE_BYTES and time.monotonic() < deadline:
            n = transfer.readinto(memoryview(buffer)[received:])
            if not n:
                return "it is empty" if not received else None
            received += n
        return None if received else f"no byte within {timeout:g} s"
    except (TransientSourceError, PermanentSourceError) as exc:
        return str(exc)
    finally:
        transfer.close()
