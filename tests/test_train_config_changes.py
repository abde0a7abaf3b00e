"""A resume compares its run config with the run's recorded one key by key (config_changes.py): a change to what is
trained is refused (exit 2, one line per key with its old and new value, nothing written) unless --allow-change
names it; a change that trains the same thing goes through; each accepted change is appended to
config_changes.jsonl, run_config.yaml is never rewritten, and the changed schedule is the documented one.

The end-to-end test trains one process, 2 steps of the tiny model, then resumes it with a longer stage and another
peak learning rate (2 more steps)."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import warm_python
from file_snapshots import snapshot
from train_fixtures import (REPO_ROOT, ranks_cmd, read_jsonl, run_env, run_job, tiny_config, train_in_process,
                            write_config)

DOCS = REPO_ROOT / "docs" / "training.md"


def _cfg(tmp_path: Path, *overrides: str):
    from crate_clip.train.run.run_config import apply_override, config_from_dict

    raw = tiny_config(tmp_path / "run", tmp_path / "data")
    for assignment in overrides:
        apply_override(raw, assignment)
    return config_from_dict(raw, check_paths=False)


# one change in every section of the run config: (override, the key it changes, free to change)
EVERY_SECTION = [
    ("run.seed=4", "run.seed", False),
    ("run.name=other", "run.name", True),
    ("run.output_dir=/elsewhere/run", "run.output_dir", True),
    ("run.max_nonfinite_in_a_row=9", "run.max_nonfinite_in_a_row", True),
    ("model.name=CRATE-alpha-CLIPA-tiny-crate-text", "model.name", False),
    ("model.lock_logit_scale=true", "model.lock_logit_scale", False),
    ("model.attention=math", "model.attention", False),
    ("model.grad_checkpointing=true", "model.grad_checkpointing", True),
    ("data.sources=[/other/train]", "data.sources", False),
    ("data.weights=[1.0]", "data.weights", False),
    ("data.mode=epoch", "data.mode", False),
    ("data.shuffle_buffer=7", "data.shuffle_buffer", False),
    ("data.canonical_streams=4", "data.canonical_streams", False),
    ("data.num_workers=3", "data.num_workers", True),
    ("data.prefetch_factor=4", "data.prefetch_factor", True),
    ("stages.1.lr=0.01", "stages.1.lr", False),
    ("stages.0.samples=320", "stages.0.samples", False),
    ("stages.1.text_mask=block", "stages.1.text_mask", False),
    ("stages.1.micro_batch=4", "stages.1.micro_batch", True),
    ("optimizer.betas=[0.9, 0.98]", "optimizer.betas", False),
    ("optimizer.grad_clip=0.5", "optimizer.grad_clip", False),
    ("precision=bf16", "precision", False),
    ("deepspeed.zero_stage=3", "deepspeed.zero_stage", True),
    ("deepspeed.overrides={communication_data_type: fp32}", "deepspeed.overrides.communication_data_type", False),
    ("train.ema.decay=0.99", "train.ema.decay", False),   # the EMA weights evaluated and exported: named
    ("checkpoint.every_steps=5", "checkpoint.every_steps", True),
    ("checkpoint.keep_last=1", "checkpoint.keep_last", True),
    ("eval.after_each_stage=false", "eval.after_each_stage", True),
    ("eval.evals.0.batch_size=10", "eval.evals.0.batch_size", True),
    ("logging.every_steps=3", "logging.every_steps", True),
    ("logging.diagnostics_every=2", "logging.diagnostics_every", True),
]


def test_every_section_is_compared_key_by_key_and_classified(tmp_path):
    from crate_clip.train.checkpointing.config_changes import ABSENT, compare
    from crate_clip.train.run.run_config import RunConfig

    base = _cfg(tmp_path).to_dict()
    for override, key, free in EVERY_SECTION:
        changes = compare(base, _cfg(tmp_path, override).to_dict())
        assert [(c.key, c.free) for c in changes] == [(key, free)], override
        assert changes[0].old is ABSENT if key.startswith("deepspeed.overrides") else changes[0].old != changes[0].new
    assert {key.split(".")[0] for _, key, _ in EVERY_SECTION} == set(RunConfig.model_fields)   # every section
    two = compare(base, _cfg(tmp_path, "stages.1.lr=0.01", "stages.1.samples=640").to_dict())
    assert [c.line() for c in two] == ["stages.1.samples: 64 -> 640", "stages.1.lr: 0.0002 -> 0.01"]


def test_a_key_not_listed_as_free_is_a_change_to_what_is_trained():
    from crate_clip.train.checkpointing.config_changes import FREE_TO_CHANGE, is_free, matches

    assert not is_free("loss.kind") and not is_free("data.some_new_key") and not is_free("stages.3.new_setting")
    assert not is_free("stages.2") and not is_free("deepspeed") and not is_free("runs.name")
    assert is_free("logging.anything_new") and is_free("stages.12.micro_batch")   # a free section: all its keys
    assert matches("stages.1", "stages.1.lr") and matches("stages.*.lr", "stages.0.lr")
    assert not matches("stages.1", "stages.10.lr") and not matches("stages.1.lr", "stages.1")
    assert all(not pattern.startswith(("stages.*.lr", "model.name", "run.seed")) for pattern in FREE_TO_CHANGE)


def test_every_free_key_is_a_key_of_the_run_config(tmp_path):
    from crate_clip.train.checkpointing.config_changes import FREE_TO_CHANGE, flat, matches

    keys = flat(_cfg(tmp_path).to_dict())
    assert [pattern for pattern in FREE_TO_CHANGE if not any(matches(pattern, key) for key in keys)] == []


def test_stages_added_and_removed_are_one_change_each_and_replay_in_order(tmp_path):
    from crate_clip.train.checkpointing.config_changes import ABSENT, apply_changes, compare

    stage = {"name": "s", "image_size": 28, "context_length": 16, "samples": 32, "global_batch": 16}
    four = _cfg(tmp_path, f"stages=[{json.dumps(stage)}, {json.dumps(dict(stage, name='t'))}, "
                          f"{json.dumps(dict(stage, name='u'))}, {json.dumps(dict(stage, name='v'))}]").to_dict()
    one = _cfg(tmp_path, f"stages=[{json.dumps(dict(stage, lr=0.5))}]").to_dict()
    removed = compare(four, one)
    assert [(c.key, c.new is ABSENT) for c in removed] == [("stages.0.lr", False), ("stages.3", True),
                                                            ("stages.2", True), ("stages.1", True)]
    rows = [{"key": c.key, **({"new": c.new} if c.new is not ABSENT else {})} for c in removed]
    assert apply_changes(json.loads(json.dumps(four)), rows) == one
    added = compare(one, four)
    rows = [{"key": c.key, **({"new": c.new} if c.new is not ABSENT else {})} for c in added]
    assert [c.key for c in added] == ["stages.0.lr", "stages.1", "stages.2", "stages.3"]
    assert apply_changes(json.loads(json.dumps(one)), rows) == four


def test_an_allowed_change_that_would_break_the_runs_accounting_is_refused(tmp_path):
    from crate_clip.train.checkpointing.config_changes import ConfigChange, ResumedAt, _breaks_accounting

    where = ResumedAt(stage_index=1, step=3, global_step=13, checkpoint="stage1-step00000003")
    cfg = _cfg(tmp_path, "stages.1.samples=32")   # 2 steps of 16
    assert "stage 0 finished before stage1-step00000003" in _breaks_accounting(
        ConfigChange("stages.0.lr", 0.002, 0.01), cfg, where)
    assert "would have 2 steps but it trained 3" in _breaks_accounting(ConfigChange("stages.1.samples", 64, 32),
                                                                       cfg, where)
    assert "mix two batch sizes" in _breaks_accounting(ConfigChange("stages.1.global_batch", 16, 8),
                                                       _cfg(tmp_path, "stages.1.global_batch=8"), where)
    assert _breaks_accounting(ConfigChange("stages.1.lr", 0.0002, 0.01), cfg, where) is None
    assert _breaks_accounting(ConfigChange("optimizer.eps", 1e-6, 1e-8), cfg, where) is None


def test_the_guard_compares_what_the_run_reads_not_the_strings_written(tmp_path, monkeypatch):
    """A source behind an environment variable pointed at other data, and a relative source resumed from another
    working folder, are changes of data.sources: the first start records them as the run read them (run_reads.json,
    what stage_loop's _prepare_run_dir writes with record_run) and a resume compares with that."""
    from crate_clip.core.errors import EXIT_CONFIG
    from crate_clip.train.checkpointing.config_changes import (ConfigChangeError, config_changes, record_changes,
                                                               record_run)

    for folder in ("a/train", "b/train", "a/data/train", "b/data/train"):
        (tmp_path / folder).mkdir(parents=True)
    monkeypatch.setenv("HDATA", str(tmp_path / "a"))
    cfg = _cfg(tmp_path, "data.sources=[$HDATA/train]")
    cfg.run_dir.mkdir()
    record_run(cfg)
    assert yaml.safe_load((cfg.run_dir / "run_config.yaml").read_text())["data"]["sources"] == ["$HDATA/train"]
    assert json.loads((cfg.run_dir / "run_reads.json").read_text())["data.sources"] == [str(tmp_path / "a/train")]
    assert config_changes(cfg, "latest") == []
    monkeypatch.setenv("HDATA", str(tmp_path / "b"))
    with pytest.raises(ConfigChangeError) as refused:
        config_changes(cfg, "latest")
    assert refused.value.exit_code == EXIT_CONFIG
    assert f'  data.sources: ["{tmp_path}/a/train"] -> ["{tmp_path}/b/train"]' in str(refused.value).splitlines()
    # allowed: recorded as read; from then on the new data is the run's
    record_changes(cfg.run_dir, config_changes(cfg, "latest", ["data.sources"]), None)
    assert json.loads((cfg.run_dir / "run_reads.json").read_text())["data.sources"] == [str(tmp_path / "b/train")]
    assert config_changes(cfg, "latest") == []

    monkeypatch.chdir(tmp_path / "a")   # a relative source: what it names depends on the working folder
    relative = _cfg(tmp_path, "data.sources=[data/train]", f"run.output_dir={tmp_path / 'relative'}")
    relative.run_dir.mkdir()
    record_run(relative)
    assert config_changes(relative, "latest") == []
    monkeypatch.chdir(tmp_path / "b")
    with pytest.raises(ConfigChangeError) as refused:
        config_changes(relative, "latest")
    assert (f'  data.sources: ["{tmp_path}/a/data/train"] -> ["{tmp_path}/b/data/train"]'
            in str(refused.value).splitlines())
    # a run started before run_reads.json existed: compared as written, then recorded as this resume reads it
    (relative.run_dir / "run_reads.json").unlink()
    assert config_changes(relative, "latest") == []
    record_run(relative)
    assert json.loads((relative.run_dir / "run_reads.json").read_text())["data.sources"] == [
        str(tmp_path / "b/data/train")]


def test_a_resume_whose_run_config_yaml_is_lost_is_refused_unless_star_takes_this_config(tmp_path):
    from crate_clip.train.checkpointing.config_changes import ConfigChangeError, config_changes, record_run

    cfg = _cfg(tmp_path)
    tag = cfg.run_dir / "checkpoints" / "stage0-step00000002"   # a run's checkpoint: the folder holds a run
    tag.mkdir(parents=True)
    (tag / "crate_clip.json").write_text(json.dumps({"stage_index": 0, "step": 2, "global_step": 2}))
    rows = '{"global_step": 2, "key": "stages.0.lr", "old": 0.002, "new": 0.01}\n'
    (cfg.run_dir / "config_changes.jsonl").write_text(rows)
    with pytest.raises(ConfigChangeError) as refused:
        config_changes(cfg, "latest", ["stages.0.lr"])
    assert str(refused.value) == (
        f"--resume: {cfg.run_dir / 'run_config.yaml'} is missing, so what this run config changes of what the run "
        "trained cannot be checked; fix: restore the file (each checkpoint's crate_clip.json holds the run config it "
        "was saved with, under run_config), or resume with --allow-change '*' to take this run config as the run's "
        "record from now on") and refused.value.exit_code == 2
    assert config_changes(cfg, "latest", ["*"]) == []
    record_run(cfg)   # the resume's record: this config, the lost one's rows set aside
    assert yaml.safe_load((cfg.run_dir / "run_config.yaml").read_text()) == cfg.to_dict()
    assert (cfg.run_dir / "config_changes.orphaned.jsonl").read_text() == rows
    assert not (cfg.run_dir / "config_changes.jsonl").exists() and config_changes(cfg, "latest") == []
    assert config_changes(_cfg(tmp_path, f"run.output_dir={tmp_path / 'new'}"), "latest") == []   # no run there


DAMAGED_ROWS = [   # a line of config_changes.jsonl -> what the one-line refusal says of it
    ("stages.0.lr = 0.01", "not valid JSON ('stages.0.lr = 0.01')"),
    ('{"key": "stages.0.lr", "new": 0.01', "not valid JSON"),   # cut short: the file is rewritten whole, never torn
    ("5", "5 is not an object"),
    ('["stages.0.lr", 0.01]', "[\"stages.0.lr\", 0.01] is not an object"),
    ('{"old": 0.002, "new": 0.01}', 'its "key" is missing, not a dotted key of the run config'),
    ('{"key": 7, "new": 0.01}', 'its "key" is 7, not a dotted key of the run config'),
    ('{"key": "stages.0.lr", "new": 0.01, "global_step": "6"}', "its 'global_step' is \"6\", not a count"),
    ('{"key": "stages.9.lr", "new": 0.01}', "stages.9: '9' is not an index of a list of 2 (applied to "),
    ('{"key": "run.seed.x", "new": 1}', "run.seed.x: run.seed is a value (3), not a section (applied to "),
]


def test_a_damaged_config_changes_jsonl_is_one_line_naming_the_line(tmp_path):
    """recorded_config is what train --resume (and --validate, the demo) and plan --resume read the record with; the
    end-to-end test below runs both commands on one such line."""
    from crate_clip.core.errors import ConfigError
    from crate_clip.train.checkpointing.config_changes import recorded_config, record_run

    cfg = _cfg(tmp_path)
    cfg.run_dir.mkdir()
    record_run(cfg)
    path = cfg.run_dir / "config_changes.jsonl"
    for line, said in DAMAGED_ROWS:
        path.write_text('{"global_step": 2, "key": "stages.0.lr", "old": 0.002, "new": 0.01}\n' + line + "\n")
        with pytest.raises(ConfigError) as refused:
            recorded_config(cfg.run_dir)
        assert str(refused.value).startswith(f"{path}, line 2: {said}") and "\n" not in str(refused.value), line
        assert "fix: correct or remove that line" in str(refused.value)


def test_docs_table_lists_the_free_keys_of_the_code():
    from crate_clip.train.checkpointing.config_changes import FREE_TO_CHANGE

    text = DOCS.read_text()
    section = text.split("## Changing the config of a run", 1)[1].split("\n## ", 1)[0]
    free = {key for row in re.findall(r"^\| free to change \| (.+?) \|", section, re.M)
            for key in re.findall(r"`([^`]+)`", row)}
    assert free == set(FREE_TO_CHANGE)
    assert "| refused unless allowed |" in section


# ---------------------------------------------------------------- end to end
def _train(config: Path, *extra: str) -> subprocess.CompletedProcess:
    return warm_python.run([sys.executable, "-m", "crate_clip.train.cli", "--config", str(config), *extra],
                           env=run_env(), cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)


def _snapshot(folder: Path) -> dict:
    """The run folder and what lies beside it under its name (its lock, the config run.yaml), as file_snapshots
    records them."""
    return {k: v for k, v in snapshot(folder.parent).items()
            if k.split("/")[0] == folder.name or k.startswith(folder.name + ".")}


@pytest.mark.slow
def test_a_changed_resume_is_refused_unless_named_then_recorded_and_scheduled_as_documented(tmp_path, tiny_fmnist,
                                                                                            capsys):
    from crate_clip.cli import main
    from crate_clip.core.errors import EXIT_CONFIG
    from crate_clip.train.demo import _refused_changes
    from crate_clip.train.run.run_config import load_run_config
    from crate_clip.train.stage_setup.optim import warmup_cosine

    stage = {"name": "only", "image_size": 16, "context_length": 16, "samples": 16, "global_batch": 8, "lr": 2e-3,
             "warmup_steps": 1, "min_lr": 1e-4}
    cfg = tiny_config(tmp_path / "run", tiny_fmnist, zero_stage=1, precision="fp32", stages=[stage], evals=False,
                      logging={"every_steps": 1, "progress": False, "tensorboard": False, "plot": False})
    cfg["data"]["num_workers"] = 0
    config, run_dir = write_config(cfg, tmp_path / "run.yaml"), tmp_path / "run"
    train_in_process(config)   # the runs that go through: in this process; the refusals: the command's own output
    recorded = (run_dir / "run_config.yaml").read_bytes()

    # a longer stage at another peak LR, not named: refused before any work, one line per key, nothing written
    changed = ("--set", "stages.0.lr=0.01", "--set", "stages.0.samples=32", "--set", "checkpoint.keep_last=5")
    before = _snapshot(run_dir)
    refused = _train(config, "--resume", "latest", *changed)
    assert refused.returncode == EXIT_CONFIG, refused.stderr[-6000:]
    lines = refused.stderr.splitlines()
    assert "  stages.0.lr: 0.002 -> 0.01" in lines and "  stages.0.samples: 16 -> 32" in lines, refused.stderr
    assert not any("keep_last" in line for line in lines)   # free to change: not refused
    assert "--allow-change stages.0.samples --allow-change stages.0.lr" in refused.stderr
    assert "Traceback" not in refused.stderr and _snapshot(run_dir) == before
    # two ranks: rank 0 decides for both, says it once, and both exit 2 (fork_ranks passes the ranks' code on)
    job = run_job(ranks_cmd(2, "--config", str(config), "--resume", "latest", *changed,
                            module="crate_clip.train.cli"))
    assert job.returncode == EXIT_CONFIG, job.stderr[-6000:]
    assert job.stderr.splitlines().count("  stages.0.lr: 0.002 -> 0.01") == 1 and _snapshot(run_dir) == before
    # the demo says it before torchrun starts its workers
    assert _refused_changes(str(config), ["stages.0.lr=0.01"], []) == EXIT_CONFIG
    assert "  stages.0.lr: 0.002 -> 0.01" in capsys.readouterr().err.splitlines()
    assert _refused_changes(str(config), ["stages.0.lr=0.01"], ["stages.0"]) == 0 and _snapshot(run_dir) == before

    # named: it goes through, is recorded, the first run_config.yaml stays as it was
    train_in_process(load_run_config(config, [a for a in changed if a != "--set"]), resume="latest",
                     allow_changes=("stages.0.lr", "stages.0.samples"))
    assert (run_dir / "run_config.yaml").read_bytes() == recorded
    rows = read_jsonl(run_dir / "config_changes.jsonl")
    assert [(r["global_step"], r["key"], r["old"], r["new"], r["named"]) for r in rows] == [
        (2, "stages.0.samples", 16, 32, True), (2, "stages.0.lr", 0.002, 0.01, True),
        (2, "checkpoint.keep_last", 3, 5, False)]
    # the stage goes on to 4 steps; the LR of each step is the new settings' schedule at that step
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in metrics] == [1, 2, 3, 4]
    for r in metrics[2:]:
        expected = 0.01 * warmup_cosine(r["step"] - 1, total_steps=4, warmup_steps=1, min_ratio=1e-4 / 0.01)
        assert r["lr"] == pytest.approx(expected, rel=1e-12), r
    info = json.loads((run_dir / "checkpoints" / "stage0-step00000004" / "crate_clip.json").read_text())
    assert (info["stage_steps"], info["global_step"], info["samples_seen"]) == (4, 4, 32)
    # the planner plans with the recorded config and its changes, also from the checkpoint written before them
    before_change = run_dir / "checkpoints" / "stage0-step00000002"
    assert json.loads((before_change / "crate_clip.json").read_text())["stage_steps"] == 2
    assert main(["plan", "--resume", str(before_change), "--gpus", "1", "--gpu-memory", "1GiB", "--no-memory"]) == 0
    assert "(stage 0 only, step 2 of 4, global step 2;" in capsys.readouterr().out

    # later resumes compare with the recorded config and its changes: the changed config needs no flag (the run is
    # finished: nothing to train), the first one is now the change
    train_in_process(load_run_config(config, [a for a in changed if a != "--set"]), resume="latest")
    back = _train(config, "--resume", "latest")
    assert back.returncode == EXIT_CONFIG and "  stages.0.lr: 0.01 -> 0.002" in back.stderr.splitlines()
    assert len(read_jsonl(run_dir / "config_changes.jsonl")) == 3
    assert yaml.safe_load(recorded)["stages"][0]["lr"] == 0.002
    assert json.loads((run_dir / "run_reads.json").read_text())["data.sources"] == [str(tiny_fmnist / "train")]

    # a damaged config_changes.jsonl: one line naming the file and the line, from train and plan, nothing written
    path, rows = run_dir / "config_changes.jsonl", (run_dir / "config_changes.jsonl").read_text()
    path.write_text(rows + '{"key": "stages.0.lr", "new": 0.5, "global_step": -1}\n')
    before = _snapshot(run_dir)
    said = f"{path}, line 4: its 'global_step' is -1, not a count; fix: correct or remove that line"
    damaged = _train(config, "--resume", "latest", *changed)
    assert damaged.returncode == EXIT_CONFIG and damaged.stderr.startswith(f"crate-clip train: {said}"), \
        damaged.stderr[-3000:]
    assert len([line for line in damaged.stderr.splitlines() if line.strip()]) == 1
    capsys.readouterr()
    assert main(["plan", "--resume", str(run_dir), "--gpus", "1", "--gpu-memory", "1GiB", "--no-memory"]) == 2
    assert capsys.readouterr().err.startswith(f"crate-clip plan: {said}") and _snapshot(run_dir) == before
    # run_config.yaml lost: a resume with another lr is refused (it would go through and write a new record)
    path.write_text(rows)
    (run_dir / "run_config.yaml").unlink()
    before = _snapshot(run_dir)
    lost = _train(config, "--resume", "latest", "--set", "stages.0.lr=0.05")
    assert lost.returncode == EXIT_CONFIG and "run_config.yaml is missing" in lost.stderr, lost.stderr[-3000:]
    assert "Traceback" not in lost.stderr and _snapshot(run_dir) == before
