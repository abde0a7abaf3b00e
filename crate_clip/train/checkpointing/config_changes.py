"""A resumed run trains what its run folder says it trained: the resumed config is compared, key by key, with the
one recorded at the first start (run_config.yaml, never rewritten, plus the changes accepted since, in
config_changes.jsonl).

FREE_TO_CHANGE below is the one list of the keys a resume may change without saying so (how the same training is
run, watched or saved). Every other key (what is trained: model, text lock, data, seed, stages, optimizer,
precision; a key added to the schema later included) is refused unless `--allow-change KEY` names it; each change
that goes through is appended to config_changes.jsonl (step, key, old, new). docs/training.md ("Changing the config
of a run") shows the same table, checked against this one by tests/test_train_config_changes.py.

An allowed change must keep the run's accounting whole: the stages before the checkpoint's are finished (their
settings are history), the checkpoint's stage cannot end before the step it reached, and its global batch cannot
change once it took a step (its steps would count two batch sizes).

What is compared is what the run reads: the keys that name files and data (READ_KEYS) are compared as the run reads
them (read_form: environment variables expanded, `~` and relative paths made absolute), so `$DATA` pointed at other
shards, or a relative source resumed from another working folder, is a change of data.sources. The first start
records these forms in run_reads.json beside run_config.yaml; each change that goes through updates them. A run
started before that record existed has none: its first resume compares the keys as written (both sides read as of
this resume) and records them so. A resume of a run folder whose run_config.yaml is missing is refused (the record
to compare with is gone) unless `--allow-change '*'` takes this config as the run's record; a config_changes.jsonl
that is not what record_changes writes is refused in one line naming the file and line, never skipped.
"""
from __future__ import annotations

import copy
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional

import torch.distributed as tdist
import yaml

from crate_clip.checkpoint_io.atomic_files import atomic_write_text
from crate_clip.checkpoint_io.bounded_reads import UnreadableRecordError, read_small_bytes, read_small_json
from crate_clip.checkpoint_io.checkpoint_choice import RESUME, choose_checkpoint
from crate_clip.checkpoint_io.checkpoint_record import read_record
from crate_clip.checkpoint_io.run_layout import (CONFIG_CHANGES_FILE, ORPHANED_CHANGES_FILE, RUN_CONFIG_FILE,
                                                 RUN_READS_FILE, checkpoints_dir)
from crate_clip.core.errors import ConfigError
from crate_clip.core.safe_yaml import load_yaml_file
from crate_clip.core.shard_sources import is_remote
from crate_clip.train.stage_setup.engine import DistInfo
from crate_clip.train.run.run_config import RunConfig, config_from_dict
from crate_clip.train.run.run_dir import LinkedRunPartError, check_run_links, is_run_folder

# key pattern (dotted; `*` is any one part; a section names all its keys) -> why changing it trains the same thing
FREE_TO_CHANGE: dict[str, str] = {
    "run.name": "the run's label",
    "run.output_dir": "where the run folder is (a folder moved or mounted elsewhere)",
    "run.max_nonfinite_in_a_row": "when the run gives up on non-finite losses",
    "run.lost_rank_timeout_s": "when a job gives up on a rank it no longer hears from",
    "model.grad_checkpointing": "recomputes the same activations in the backward (memory, not values)",
    "data.num_workers": "loader processes per rank: the sample order is fixed by data.canonical_streams",
    "data.prefetch_factor": "batches each loader worker prepares ahead",
    "data.remote_retry_total_s": "how long a remote shard's outage is retried (the samples stay the same)",
    "data.remote_stall_timeout_s": "when a stalled remote transfer is retried",
    "data.remote_backoff_base_s": "the first wait between retries of a remote shard",
    "data.remote_backoff_max_s": "the longest wait between retries of a remote shard",
    "data.remote_min_bytes_per_s": "the throughput below which a remote transfer counts as stalled",
    "stages.*.checkpoint_blocks": "recomputes the same activations in the backward (memory, not values)",
    "stages.*.micro_batch": "how a rank's batch is split into accumulation steps (exact contrastive gradients), "
                            "like the process count",
    "deepspeed.zero_stage": "how weights and optimizer states are partitioned (the elastic resume path)",
    "checkpoint": "checkpoint cadence and how many are kept",
    "eval": "the evaluations after each stage and during it (every_samples / every_steps, max_time_share)",
    "logging": "metrics cadence, progress display, trackers (report_to), plot, white-box diagnostics",
}
# train.ema (the average kept beside the trained weights) is not free: its keys change the EMA weights the run
# evaluates and exports, a product of the run that config_changes.jsonl accounts for, so a resume changes them only
# where --allow-change names them. Named, a change acts from the checkpoint resumed from (train/loop/parts/
# ema_weights.py): the saved average goes on with the new decay and every_steps; turned on, the average starts at
# the resume step (or at start_step, if that is later); turned off, the saved average is dropped. The trained
# weights are the same either way, so no train.ema change breaks the run's accounting (_breaks_accounting).
# keys a first launch settles when the config leaves them unset, recorded in run_config.yaml: unset on a resume
# means "the recorded value" (elastic_resume.launch_stream_settings reads it back from the checkpoint)
SETTLED_AT_FIRST_LAUNCH = ("data.canonical_streams", "data.shuffle_buffer")
# keys whose values name what the run reads: compared as the run reads them (read_form), recorded in run_reads.json
READ_KEYS = ("data.sources", "model.pretrained", "model.text_pretrained", "model.bert_vocab", "deepspeed.config")
ALL_KEYS = "*"   # --allow-change '*': every key; the one way past a lost run_config.yaml
MAX_CHANGES_BYTES = 64 << 20   # config_changes.jsonl: a row per change a resume made (a few hundred bytes each)


class _Absent:
    """The value of a key one side does not have: a stage added or removed, a DeepSpeed override."""

    def __repr__(self) -> str:
        return "(absent)"

    def __reduce__(self) -> str:   # pickled (sent to the other ranks) as this module's ABSENT: `is` still holds
        return "ABSENT"


ABSENT = _Absent()


class ConfigChangeError(ConfigError):
    """A resume that changes what the run trains without naming it, or that its progress does not allow."""
    once_per_job = True   # rank 0 decides for every rank: rank 0 says it


@dataclass(frozen=True)
class ConfigChange:
    """One key whose value differs between the run's recorded config and the resumed one."""
    key: str
    old: Any = ABSENT
    new: Any = ABSENT
    free: bool = False          # FREE_TO_CHANGE: goes through unnamed

    def line(self) -> str:
        """`key: old -> new`, values as in YAML's flow style."""
        return f"{self.key}: {_shown(self.old)} -> {_shown(self.new)}"


# ---------------------------------------------------------------- the comparison
def matches(pattern: str, key: str) -> bool:
    """Whether dotted `pattern` names `key`: part by part (`*` is any one part), a section naming all its keys."""
    parts, key_parts = pattern.split("."), key.split(".")
    return len(parts) <= len(key_parts) and all(p in ("*", k) for p, k in zip(parts, key_parts))


def is_free(key: str) -> bool:
    """True for a key FREE_TO_CHANGE names (a change to it trains the same thing); any other key is trained."""
    return any(matches(pattern, key) for pattern in FREE_TO_CHANGE)


def flat(value: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted key -> value: sections and lists of sections (stages, eval.evals) opened, other lists are values."""
    if isinstance(value, dict) and value:
        return {k: v for name, item in value.items() for k, v in flat(item, _join(prefix, name)).items()}
    if isinstance(value, list) and value and all(isinstance(item, dict) for item in value):
        return {k: v for i, item in enumerate(value) for k, v in flat(item, _join(prefix, str(i))).items()}
    return {prefix: value}


def compare(recorded: dict, resumed: dict) -> list[ConfigChange]:
    """Every key whose value differs, in the config's order; a list item only one side has is one change (the
    whole stage), removals last and from the end, so that replaying them in order (apply_changes) works."""
    changes, removed = [], []
    _diff(recorded, resumed, "", changes, removed)
    return changes + removed[::-1]


def _diff(old: Any, new: Any, key: str, changes: list, removed: list) -> None:
    if isinstance(old, dict) and isinstance(new, dict):
        for name in [*old, *(n for n in new if n not in old)]:
            sub = _join(key, name)
            if name not in new:
                removed.append(ConfigChange(sub, old[name], ABSENT, is_free(sub)))
            elif name not in old:
                changes.append(ConfigChange(sub, ABSENT, new[name], is_free(sub)))
            else:
                _diff(old[name], new[name], sub, changes, removed)
    elif _sections(old) and _sections(new):
        for i in range(max(len(old), len(new))):
            sub = _join(key, str(i))
            if i >= len(new):
                removed.append(ConfigChange(sub, old[i], ABSENT, is_free(sub)))
            elif i >= len(old):
                changes.append(ConfigChange(sub, ABSENT, new[i], is_free(sub)))
            else:
                _diff(old[i], new[i], sub, changes, removed)
    elif old != new:
        changes.append(ConfigChange(key, old, new, is_free(key)))


def apply_changes(raw: dict, records: Iterable[dict]) -> dict:
    """`raw` with each recorded change (config_changes.jsonl rows) set in order; returns it. ValueError naming the
    key when a row does not fit the config it is applied to (a list index out of range, a value where a section
    belongs)."""
    for record in records:
        _apply_one(raw, record["key"], record)
    return raw


def _apply_one(raw: dict, key: str, record: dict) -> None:
    *path, last = key.split(".")
    node: Any = raw
    for depth, part in enumerate(path):
        node = _child(node, part, ".".join(path[:depth + 1]))
    if isinstance(node, list):
        index = _index(node, last, key, extra=1 if "new" in record else 0)
        if "new" not in record:
            del node[index]
        elif index == len(node):
            node.append(record["new"])
        else:
            node[index] = record["new"]
    elif not isinstance(node, dict):
        raise ValueError(f"{key}: {'.'.join(path)} is a value ({_shown(node)[:40]}), not a section")
    elif "new" not in record:
        node.pop(last, None)
    else:
        node[last] = record["new"]


def _child(node: Any, part: str, where: str) -> Any:
    """The item `part` of a section or list on a row's path (a section missing on the way is created)."""
    if isinstance(node, list):
        return node[_index(node, part, where)]
    if isinstance(node, dict):
        return node.setdefault(part, {})
    raise ValueError(f"{where}: {where.rsplit('.', 1)[0]} is a value ({_shown(node)[:40]}), not a section")


def _index(node: list, part: str, where: str, extra: int = 0) -> int:
    """`part` as an index of `node` (`extra` 1: one past the end appends)."""
    if not part.isdigit() or int(part) >= len(node) + extra:
        raise ValueError(f"{where}: {part!r} is not an index of a list of {len(node)}")
    return int(part)


def read_change_rows(run_dir: Path) -> list[tuple[int, dict]]:
    """(line number, row) of each row of the run's config_changes.jsonl ([] without it); ConfigError in one line
    naming the file and the line when a line is not a row record_changes writes (not JSON, not an object, no
    dotted `key`, a step that is not a count). record_changes rewrites the file whole and atomically: a line cut
    short is damage too, never skipped."""
    path = Path(run_dir) / CONFIG_CHANGES_FILE
    fix = (f"fix: correct or remove that line (each line is one change a resume made: {{\"key\": ..., \"old\": ..., "
           f"\"new\": ...}}), or restore the file from a copy")
    try:
        text = read_small_bytes(path, MAX_CHANGES_BYTES).decode("utf-8")
    except FileNotFoundError:
        return []
    except (UnreadableRecordError, OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: {' '.join(str(exc).split())}; {fix}") from None
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except (json.JSONDecodeError, RecursionError):
            raise ConfigError(f"{path}, line {number}: not valid JSON ({line[:60]!r}); {fix}") from None
        problem = _row_problem(row)
        if problem:
            raise ConfigError(f"{path}, line {number}: {problem}; {fix}")
        rows.append((number, row))
    return rows


def _row_problem(row: Any) -> Optional[str]:
    """Why a parsed line of config_changes.jsonl is not a change row, or None."""
    if not isinstance(row, dict):
        return f"{_shown(row)[:40]} is not an object"
    key = row.get("key")
    if not isinstance(key, str) or not key or any(not part for part in key.split(".")):
        return f"its \"key\" is {_shown(key)[:40] if 'key' in row else 'missing'}, not a dotted key of the run config"
    for name in ("global_step", "stage_index", "step"):
        value = row.get(name, 0)
        if type(value) is not int or value < 0:
            return f"its {name!r} is {_shown(value)[:40]}, not a count"
    return None


# ---------------------------------------------------------------- the run folder's record
def recorded_config(run_dir: Path) -> Optional[dict]:
    """The config the run in `run_dir` trains with: its run_config.yaml (the first start's) with the changes of
    config_changes.jsonl applied, every key filled in as this version reads it; None without run_config.yaml.
    ConfigError (one line naming the file, and the line) for a record that cannot be read."""
    path = Path(run_dir) / RUN_CONFIG_FILE
    if not os.path.lexists(path):
        return None
    try:   # bounded like a run config: a run folder from elsewhere is data too
        raw = load_yaml_file(path, "the run's record") or {}
    except ConfigError as exc:
        raise ConfigError(f"{exc}; it records what the run trained: restore it, or start over with "
                          "--overwrite") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: holds {type(raw).__name__}, not a run config; it records what the run trained: "
                          "restore it, or start over with --overwrite")
    changes = Path(run_dir) / CONFIG_CHANGES_FILE
    for number, row in read_change_rows(run_dir):
        try:
            _apply_one(raw, row["key"], row)
        except ValueError as exc:
            raise ConfigError(f"{changes}, line {number}: {exc} (applied to {path} and the lines before it); fix: "
                              "correct or remove that line, or restore the file from a copy") from None
    try:   # keys added to the schema since the run started read as their defaults (which keep the old behaviour)
        return _as_recorded(config_from_dict(raw, check_paths=False).to_dict())
    except ConfigError:   # a key this version no longer knows: compared as written
        return raw


def _as_recorded(raw: dict) -> dict:
    """A config dict as run_config.yaml holds it (YAML's types: tuples are lists)."""
    return yaml.safe_load(yaml.safe_dump(raw, sort_keys=False))


# ---------------------------------------------------------------- what the run reads
def read_form(key: str, value: Any) -> Any:
    """A READ_KEYS value as the run reads it in this process: a data source with `~` and environment variables
    expanded (shard_sources reads it so), local paths absolute (against the working folder); a URL, a `pipe:`
    command and a hub name (model.text_pretrained) are not paths."""
    if key == "data.sources":
        return [read_form("data.source", source) for source in value] if isinstance(value, list) else value
    if not isinstance(value, str):
        return value
    if key == "data.source":
        expanded = os.path.expandvars(os.path.expanduser(value))
        return expanded if is_remote(expanded) or "://" in expanded else os.path.abspath(expanded)
    if key == "model.text_pretrained":
        if value.startswith("local-dir:"):
            return "local-dir:" + os.path.abspath(os.path.expanduser(value[len("local-dir:"):]))
        return os.path.abspath(os.path.expanduser(value)) if os.path.exists(os.path.expanduser(value)) else value
    return os.path.abspath(os.path.expanduser(value))


def read_forms(config: dict) -> dict[str, Any]:
    """READ_KEYS -> their values in `config` as the run reads them now (read_form)."""
    values = flat(config)
    return {key: read_form(key, values.get(key)) for key in READ_KEYS}


def recorded_reads(run_dir: Path, recorded: dict) -> dict[str, Any]:
    """READ_KEYS -> what the run read: run_reads.json's (recorded at the first start, updated by each change that
    went through); a key it lacks (a run started before the record existed) as the recorded config reads now."""
    path = Path(run_dir) / RUN_READS_FILE
    try:
        saved = read_small_json(path)
    except FileNotFoundError:
        saved = {}
    except (UnreadableRecordError, OSError) as exc:
        raise ConfigError(f"{' '.join(str(exc).split())}; it records the data and files the run read: restore it, "
                          f"or remove it to compare {', '.join(READ_KEYS)} as run_config.yaml writes them") from None
    if not isinstance(saved, dict):
        raise ConfigError(f"{path}: holds {type(saved).__name__}, not an object of key -> value; restore it, or "
                          f"remove it to compare {', '.join(READ_KEYS)} as run_config.yaml writes them")
    now = read_forms(recorded)
    return {key: saved[key] if key in saved else now[key] for key in READ_KEYS}


def _with_values(config: dict, values: dict[str, Any]) -> dict:
    """A copy of `config` with each dotted key of `values` set to its value."""
    config = copy.deepcopy(config)
    for key, value in values.items():
        *path, last = key.split(".")
        node = config
        for part in path:
            node = node.setdefault(part, {})
        if value is not None or last in node:
            node[last] = value
    return config


def record_run(cfg: RunConfig, stream=None) -> None:
    """Rank 0, once a start or resume is checked: the run's record of what it trains, at the first start
    (run_config.yaml, never rewritten: config_changes.jsonl records what resumes change; and run_reads.json), and
    run_reads.json for a run started before it existed. A run_config.yaml lost and taken again from this config
    (--allow-change '*'): the rows of config_changes.jsonl, which changed the lost one, are set aside first.
    `stream`: the stream settings the launch settled, recorded with the config (RunConfig.to_dict)."""
    run_dir = cfg.run_dir
    recorded = recorded_config(run_dir)
    if recorded is None:
        changes = run_dir / CONFIG_CHANGES_FILE
        if changes.exists():
            orphaned = run_dir / ORPHANED_CHANGES_FILE
            earlier = orphaned.read_text() if orphaned.is_file() else ""
            atomic_write_text(orphaned, earlier + changes.read_text())
            changes.unlink()
            print(f"[note] {run_dir / RUN_CONFIG_FILE} was missing: this run config is the run's record from now on "
                  f"(--allow-change '*'); the changes recorded against the lost one are kept in {orphaned}",
                  flush=True)
        atomic_write_text(run_dir / RUN_CONFIG_FILE, yaml.safe_dump(cfg.to_dict(stream), sort_keys=False))
        _write_reads(run_dir, read_forms(_as_recorded(cfg.to_dict(stream))))
    elif not (run_dir / RUN_READS_FILE).exists():
        _write_reads(run_dir, read_forms(recorded))


def _write_reads(run_dir: Path, reads: dict[str, Any]) -> None:
    atomic_write_text(Path(run_dir) / RUN_READS_FILE, json.dumps(reads, indent=1))


@dataclass(frozen=True)
class ResumedAt:
    """Where a resume continues (what a checkpoint's crate_clip.json records of it)."""
    stage_index: int
    step: int
    global_step: int
    checkpoint: str


def resumed_at(run_dir: Path, resume: Optional[str]) -> Optional[ResumedAt]:
    """The checkpoint `resume` names (latest, auto: the newest complete one of the run; or a path), as the resume
    chooses it (checkpoint_choice.py), from its JSON record only; None when there is none (the trainer's own checks
    say why)."""
    if not resume:
        return None
    try:
        tag_dir = choose_checkpoint(resume, RESUME, run_checkpoints=checkpoints_dir(run_dir)).tag_dir
    except (ValueError, OSError):   # the resume refuses it, saying why
        return None
    record = read_record(tag_dir) if tag_dir is not None else None
    if record is None:
        return None
    progress = record.progress
    return ResumedAt(progress.stage_index, progress.step, progress.global_step, tag_dir.name)


def config_changes(cfg: RunConfig, resume: Optional[str], allowed: Iterable[str] = ()) -> list[ConfigChange]:
    """The changes a resume of `cfg`'s run makes to its recorded config: [] for a fresh start or a folder without
    run_config.yaml. Raises ConfigError, one line per key with its old and new value, when a change to what is
    trained is not named in `allowed` (--allow-change), an allowed one would break the run's accounting, or an
    `allowed` key names no key of the config."""
    if not resume:
        return []
    check_run_links(cfg.run_dir, resume)   # before the run folder is read
    allowed = list(allowed)
    recorded = recorded_config(cfg.run_dir)
    if recorded is None:
        if is_run_folder(cfg.run_dir) and ALL_KEYS not in allowed:   # its checkpoints, without their record
            raise ConfigChangeError(
                f"--resume: {cfg.run_dir / RUN_CONFIG_FILE} is missing, so what this run config changes of what "
                f"the run trained cannot be checked; fix: restore the file (each checkpoint's crate_clip.json holds "
                f"the run config it was saved with, under run_config), or resume with --allow-change '*' to take "
                f"this run config as the run's record from now on")
        return []
    recorded = _with_values(recorded, recorded_reads(cfg.run_dir, recorded))
    resumed = _as_recorded(cfg.to_dict())
    resumed = _with_values(resumed, read_forms(resumed))
    for key in SETTLED_AT_FIRST_LAUNCH:   # unset on the resume: the recorded value
        section, name = key.split(".")
        if resumed.get(section, {}).get(name) is None and name in recorded.get(section, {}):
            resumed[section][name] = recorded[section][name]
    _check_allowed_keys(allowed, recorded, resumed)
    changes = compare(recorded, resumed)
    where = resumed_at(cfg.run_dir, resume)
    broken = {c.key: f"{c.line()}: {why}" for c in changes if not c.free and (why := _breaks_accounting(c, cfg, where))}
    unnamed = [c for c in changes
               if not c.free and c.key not in broken and not any(matches(a, c.key) for a in allowed)]
    if unnamed or broken:
        raise ConfigChangeError(_refusal(cfg.run_dir, unnamed, list(broken.values())))
    return changes


def agreed_config_changes(cfg: RunConfig, resume: Optional[str], allowed: Iterable[str],
                          dist: DistInfo) -> list[ConfigChange]:
    """config_changes as rank 0 finds it, on every rank (its ConfigChangeError raised on all of them)."""
    outcome: Any = None
    if dist.is_main:
        try:
            outcome = config_changes(cfg, resume, allowed)
        except ConfigError as exc:   # a link out of the run folder keeps its own exit code (4 for a resume)
            outcome = exc if isinstance(exc, (ConfigChangeError, LinkedRunPartError)) else ConfigChangeError(str(exc))
    if dist.world_size > 1 and tdist.is_initialized():
        box = [outcome]
        tdist.broadcast_object_list(box, src=0)
        outcome = box[0]
    if isinstance(outcome, ConfigError):
        raise outcome
    return outcome


def _check_allowed_keys(allowed: list[str], recorded: dict, resumed: dict) -> None:
    keys = set(flat(recorded)) | set(flat(resumed)) | {c.key for c in compare(recorded, resumed)}
    unknown = [a for a in allowed if not any(matches(a, key) for key in keys)]
    if unknown:
        raise ConfigChangeError(f"--allow-change: {', '.join(unknown)} names no key of the run config; fix: a "
                                "dotted key as --set takes it, e.g. --allow-change stages.1.lr")


def _breaks_accounting(change: ConfigChange, cfg: RunConfig, where: Optional[ResumedAt]) -> Optional[str]:
    """Why an allowed change to what is trained cannot go through at the checkpoint resumed from (None: it can)."""
    parts = change.key.split(".")
    if where is None or parts[0] != "stages" or len(parts) < 2:
        return None
    index = int(parts[1])
    if index < where.stage_index:
        return (f"stage {index} finished before {where.checkpoint}; its settings are the run's history "
                "(fix: keep the recorded value)")
    if index > where.stage_index:
        return None
    if change.new is ABSENT:
        return f"the run is in stage {index} ({where.checkpoint}); fix: keep the stage"
    stage = cfg.stages[index]
    if parts[2:] in (["samples"], ["global_batch"]) and stage.steps < where.step:
        return (f"stage {index} would have {stage.steps} steps but it trained {where.step} ({where.checkpoint}); "
                f"fix: samples of at least {where.step * stage.global_batch:,}")
    if parts[2:] == ["global_batch"] and where.step > 0:
        return (f"stage {index} trained {where.step} steps of global_batch {change.old} ({where.checkpoint}); its "
                "step counts would mix two batch sizes (fix: keep it, or change it in a later stage)")
    return None


def _refusal(run_dir: Path, unnamed: list[ConfigChange], broken: list[str]) -> str:
    lines = []
    if unnamed:
        lines.append(f"--resume: the run config changes what the run in {run_dir} trains ({RUN_CONFIG_FILE}, with "
                     f"the changes in {CONFIG_CHANGES_FILE}):")
        lines += [f"  {c.line()}" for c in unnamed]
        lines.append("fix: resume with the recorded values, or name each deliberate change: "
                     + " ".join(f"--allow-change {c.key}" for c in unnamed)
                     + ' (docs/training.md, "Changing the config of a run")')
    if broken:
        lines.append("--resume: changes that the run's progress does not allow:")
        lines += [f"  {line}" for line in broken]
    return "\n".join(lines)


def record_changes(run_dir: Path, changes: list[ConfigChange], where: Optional[ResumedAt]) -> None:
    """Append each change that went through to config_changes.jsonl (rank 0, once the resume is checked): the
    global step, stage and step resumed from, key, old and new value (a side without the key: no old / new)."""
    if not changes:
        return
    path = Path(run_dir) / CONFIG_CHANGES_FILE
    rows = []
    for change in changes:
        rows.append({"global_step": where.global_step if where else 0, "stage_index": where.stage_index if where else 0,
               "step": where.step if where else 0, "checkpoint": where.checkpoint if where else None,
               "key": change.key, **({"old": change.old} if change.old is not ABSENT else {}),
               **({"new": change.new} if change.new is not ABSENT else {}),
               "named": not change.free, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
    earlier = path.read_text() if path.is_file() else ""   # small: rewritten whole, atomically, not appended to
    earlier += "\n" if earlier and not earlier.endswith("\n") else ""
    atomic_write_text(path, earlier + "".join(json.dumps(row) + "\n" for row in rows))
    read = {c.key: (None if c.new is ABSENT else c.new) for c in changes if c.key in READ_KEYS}
    if read:   # what the run reads from now on (the compared values are the read forms)
        recorded = recorded_config(run_dir) or {}
        _write_reads(run_dir, {**recorded_reads(run_dir, recorded), **read})


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else str(name)


def _sections(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(item, dict) for item in value)


def _shown(value: Any) -> str:
    if value is ABSENT:
        return repr(ABSENT)
    return json.dumps(value) if isinstance(value, (dict, list, str)) or value is None else repr(value)

