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
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional

import torch.distributed as tdist
import yaml

from crate_clip.checkpoint_io.atomic_files import atomic_write_text
from crate_clip.checkpoint_io.checkpoint_record import latest_complete_tag, read_record
from crate_clip.checkpoint_io.run_layout import CONFIG_CHANGES_FILE, RUN_CONFIG_FILE, checkpoints_in, read_jsonl
from crate_clip.core.errors import ConfigError
from crate_clip.core.safe_yaml import load_yaml_file
from crate_clip.train.stage_setup.engine import DistInfo
from crate_clip.train.run.run_config import RunConfig, config_from_dict

# key pattern (dotted; `*` is any one part; a section names all its keys) -> why changing it trains the same thing
FREE_TO_CHANGE: dict[str, str] = {
    "run.name": "the run's label",
    "run.output_dir": "where the run folder is (a folder moved or mounted elsewhere)",
    "run.max_nonfinite_in_a_row": "when the run gives up on non-finite losses",
    "model.grad_checkpointing": "recomputes the same activations in the backward (memory, not values)",
    "data.num_workers": "loader processes per rank: the sample order is fixed by data.canonical_streams",
    "data.prefetch_factor": "batches each loader worker prepares ahead",
    "data.remote_retry_total_s": "how long a remote shard's outage is retried (the samples stay the same)",
    "data.remote_stall_timeout_s": "when a stalled remote transfer is retried",
    "data.remote_backoff_base_s": "the first wait between retries of a remote shard",
    "data.remote_backoff_max_s": "the longest wait between retries of a remote shard",
    "stages.*.checkpoint_blocks": "recomputes the same activations in the backward (memory, not values)",
    "stages.*.micro_batch": "how a rank's batch is split into accumulation steps (exact contrastive gradients), "
                            "like the process count",
    "deepspeed.zero_stage": "how weights and optimizer states are partitioned (the elastic resume path)",
    "checkpoint": "checkpoint cadence and how many are kept",
    "eval": "the evaluations after each stage and during it (every_samples / every_steps, max_time_share)",
    "logging": "metrics cadence, progress display, trackers (report_to), plot, white-box diagnostics",
}
# keys a first launch settles when the config leaves them unset, recorded in run_config.yaml: unset on a resume
# means "the recorded value" (elastic_resume.settle_canonical_streams reads it back from the checkpoint)
SETTLED_AT_FIRST_LAUNCH = ("data.canonical_streams", "data.shuffle_buffer")


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
    """`raw` with each recorded change (config_changes.jsonl rows) set in order; returns it."""
    for record in records:
        *path, last = record["key"].split(".")
        node = raw
        for part in path:
            node = node[int(part)] if isinstance(node, list) else node.setdefault(part, {})
        if isinstance(node, list):
            if "new" not in record:
                del node[int(last)]
            elif int(last) == len(node):
                node.append(record["new"])
            else:
                node[int(last)] = record["new"]
        elif "new" not in record:
            node.pop(last, None)
        else:
            node[last] = record["new"]
    return raw


# ---------------------------------------------------------------- the run folder's record
def recorded_config(run_dir: Path) -> Optional[dict]:
    """The config the run in `run_dir` trains with: its run_config.yaml (the first start's) with the changes of
    config_changes.jsonl applied, every key filled in as this version reads it; None without run_config.yaml."""
    path = Path(run_dir) / RUN_CONFIG_FILE
    if not path.is_file():
        return None
    try:   # bounded like a run config: a run folder from elsewhere is data too
        raw = load_yaml_file(path, "the run's record") or {}
    except ConfigError as exc:
        raise ConfigError(f"{exc}; it records what the run trained: restore it, or start over with "
                          "--overwrite") from None
    raw = apply_changes(raw, read_jsonl(Path(run_dir) / CONFIG_CHANGES_FILE))
    try:   # keys added to the schema since the run started read as their defaults (which keep the old behaviour)
        return _as_recorded(config_from_dict(raw, check_paths=False).to_dict())
    except ConfigError:   # a key this version no longer knows: compared as written
        return raw


def _as_recorded(raw: dict) -> dict:
    """A config dict as run_config.yaml holds it (YAML's types: tuples are lists)."""
    return yaml.safe_load(yaml.safe_dump(raw, sort_keys=False))


@dataclass(frozen=True)
class ResumedAt:
    """Where a resume continues (what a checkpoint's crate_clip.json records of it)."""
    stage_index: int
    step: int
    global_step: int
    checkpoint: str


def resumed_at(run_dir: Path, resume: Optional[str]) -> Optional[ResumedAt]:
    """The checkpoint `resume` names (latest, auto: the newest complete one of the run; or a path), from its JSON
    record only; None when there is none (the trainer's own checks say why)."""
    if not resume:
        return None
    if resume in ("latest", "auto"):
        folder = checkpoints_in(Path(run_dir))
    else:
        folder = Path(resume) if read_record(Path(resume)) is not None else checkpoints_in(Path(resume))
    tag = None if read_record(folder) is not None else latest_complete_tag(folder)
    record = read_record(folder / tag if tag else folder)
    if record is None:
        return None
    progress = record.progress
    return ResumedAt(progress.stage_index, progress.step, progress.global_step, (folder / tag if tag else folder).name)


def config_changes(cfg: RunConfig, resume: Optional[str], allowed: Iterable[str] = ()) -> list[ConfigChange]:
    """The changes a resume of `cfg`'s run makes to its recorded config: [] for a fresh start or a folder without
    run_config.yaml. Raises ConfigError, one line per key with its old and new value, when a change to what is
    trained is not named in `allowed` (--allow-change), an allowed one would break the run's accounting, or an
    `allowed` key names no key of the config."""
    recorded = recorded_config(cfg.run_dir) if resume else None
    if recorded is None:
        return []
    resumed = _as_recorded(cfg.to_dict())
    for key in SETTLED_AT_FIRST_LAUNCH:   # unset on the resume: the recorded value
        section, name = key.split(".")
        if resumed.get(section, {}).get(name) is None and name in recorded.get(section, {}):
            resumed[section][name] = recorded[section][name]
    allowed = list(allowed)
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
        except ConfigError as exc:
            outcome = ConfigChangeError(str(exc))
    if dist.world_size > 1 and tdist.is_initialized():
        box = [outcome]
        tdist.broadcast_object_list(box, src=0)
        outcome = box[0]
    if isinstance(outcome, ConfigChangeError):
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


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else str(name)


def _sections(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(item, dict) for item in value)


def _shown(value: Any) -> str:
    if value is ABSENT:
        return repr(ABSENT)
    return json.dumps(value) if isinstance(value, (dict, list, str)) or value is None else repr(value)

