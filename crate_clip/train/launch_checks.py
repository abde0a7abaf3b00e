"""Everything about a run that can be checked before any worker starts, in the process that launches them
(`crate-clip train --nproc N`, `crate-clip train --validate`, the demo): the config's keys (warm-up against the
stage's steps among them), the batches against the process count, the output folder (--overwrite moves only a
run), local data and evaluation sets present, and each remote data source answering a short probe of its first
shard. Every problem is one line; all of them come at once in one ConfigError (exit code 2), instead of a
worker's traceback under the launcher's ChildFailedError minutes later.
"""
from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Optional

from crate_clip.core.errors import ConfigError
from crate_clip.core.shard_sources import PIPE, ShardListError, expand_source, is_remote
from crate_clip.train.run_config import (RunConfig, apply_override, batch_problem, load_run_config,
                                         path_problems, runtime_problems)
from crate_clip.train.run_dir import output_dir_problems, overwrite_problem

PROBE_TIMEOUT_S = 10.0   # per remote source: a server that answers at all answers a 512-byte read far sooner
PROBE_BYTES = 512        # one tar header: the first shard is there and sends data


def checked_config(path: str | Path, overrides: list[str], *, world_size: int, device: Optional[str] = None,
                   overwrite: bool = False, probe: bool = False, run_commands: bool = False,
                   data_written: bool = True) -> RunConfig:
    """The run config of `path` with `overrides`, checked for a launch of `world_size` processes; raises one
    ConfigError listing every problem found (`probe`: also ask each http(s) data source for its first shard, and
    with `run_commands` run each `pipe:` source's first command: only when the run is launched, never for
    `--validate`, which is how a config from elsewhere is read before it runs anything; `data_written` False: the
    data and evaluation sets are written later, by the demo, so not looked for)."""
    try:
        cfg = load_run_config(path, overrides, check_paths=False)
    except ConfigError as exc:   # keys refused: add the batch lines the raw values already show
        extra = _raw_batch_problems(path, overrides, world_size)
        raise ConfigError("\n  ".join([str(exc), *extra])) from None
    problems = (path_problems(cfg, Path(path).parent) if data_written else
                output_dir_problems(cfg.run.output_dir, cfg.data.sources, [e.data for e in cfg.eval.evals]))
    problems += runtime_problems(cfg, world_size, device)
    named = any(line.startswith("run.output_dir") for line in problems)   # one line about that folder is enough
    if overwrite and not named and (problem := overwrite_problem(cfg.run_dir)):
        problems.append(problem)
    if probe:
        problems += remote_source_problems(cfg.data.sources, run_commands=run_commands)
    if problems:   # as every config refusal: one line per problem under the header
        raise ConfigError(f"invalid run config ({path}):\n  " + "\n  ".join(problems))
    return cfg


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
    """One line per remote source (http(s); pipe: with `run_commands`) whose first shard does not answer within
    `timeout` seconds."""
    problems = []
    for i, source in enumerate(sources):
        if not is_remote(source) or (source.startswith(PIPE) and not run_commands):
            continue
        try:
            shard = expand_source(source)[0]
        except (ShardListError, IndexError):
            continue   # the config check names it
        error = probe_shard(shard, timeout)
        if error:
            problems.append(f"data.sources.{i}: the first shard {shard!r} cannot be read: {error}; fix: check the "
                            "server or the command (the run would retry it, then stop), or correct the source")
    return problems


def probe_shard(shard: str, timeout: float = PROBE_TIMEOUT_S) -> Optional[str]:
    """Why the first PROBE_BYTES of a remote shard cannot be read within `timeout` seconds; None when they can.
    Schemes read through their own tools (gs://, hf://, ...) are not probed."""
    if shard.startswith(("http://", "https://")):
        return _probe_url(shard, timeout)
    if shard.startswith(PIPE):
        return _probe_command(shard[len(PIPE):], timeout)
    return None


def _probe_url(url: str, timeout: float) -> Optional[str]:
    request = urllib.request.Request(url, headers={"Range": f"bytes=0-{PROBE_BYTES - 1}"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            return None if answer.read(PROBE_BYTES) else "the server sent an empty answer"
    except urllib.error.HTTPError as exc:
        return f"HTTP {exc.code} {exc.reason}"
    except (socket.timeout, TimeoutError):
        return f"no answer within {timeout:g} s"
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        return f"no answer within {timeout:g} s" if isinstance(reason, socket.timeout) else str(reason)


def _probe_command(command: str, timeout: float) -> Optional[str]:
    """Run the shard's command until it has written PROBE_BYTES (or ended, or `timeout` passed), then stop it."""
    proc = subprocess.Popen(command, shell=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, start_new_session=True)   # a group of its own: stopped whole
    received, deadline = 0, time.monotonic() + timeout
    try:
        while received < PROBE_BYTES and (left := deadline - time.monotonic()) > 0:
            if not select.select([proc.stdout], [], [], left)[0]:
                break
            chunk = os.read(proc.stdout.fileno(), PROBE_BYTES - received)
            if not chunk:
                break
            received += len(chunk)
        if received:
            return None
        if proc.poll() is None and time.monotonic() >= deadline:
            return f"the command wrote nothing within {timeout:g} s"
        code = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        said = proc.stderr.read(4096).decode("utf-8", "replace").strip().splitlines()
        return f"the command exited with code {code} without output" + (f" ({said[-1]})" if said else "")
    except subprocess.TimeoutExpired:
        return f"the command wrote nothing within {timeout:g} s"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()
