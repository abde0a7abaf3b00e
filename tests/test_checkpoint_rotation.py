"""A run deletes only what it wrote and keeps what `crate-clip export --stage N` needs: with keep_last=1 every
finished stage keeps its last checkpoint, and the export commands of docs/export.md run as written on the run;
rotation and the clean-up of interrupted saves leave a user's files in checkpoints/ where they were, a damaged
checkpoint is moved aside in one line (never deleted), and a checkpoint folder, or a whole checkpoints/ folder,
that is a link to another run's is refused by `--resume` and `export` in one line. A resume from an earlier
checkpoint starts another line of the run: rotation, `latest`, `export --stage N` and `--resume latest` / `auto`
(also without `latest`) follow that line, not the higher steps of the one it left.

One process, the tiny model, 3 + 2 steps of batch 16, ZeRO-2 (as the demo), a checkpoint every step and
keep_last=1 (the strictest rotation); every command is the real one, forked warm (tests/warm_python.py).
"""
from __future__ import annotations

import json
import re
import shlex
import shutil
import sys
from pathlib import Path

import pytest

import warm_python
from file_snapshots import snapshot
from train_fixtures import REPO_ROOT, run_env, tiny_config, write_config

pytestmark = [pytest.mark.slow]

DOC = REPO_ROOT / "docs" / "export.md"
STAGES = [
    {"name": "low", "image_size": 16, "context_length": 16, "samples": 48, "global_batch": 16, "lr": 2e-3,
     "warmup_steps": 1},
    {"name": "full", "image_size": 28, "context_length": 16, "samples": 32, "global_batch": 16, "lr": 2e-4,
     "warmup_steps": 1},
]
STAGE0_END, STAGE1_END = "stage0-step00000003", "stage1-step00000002"


def _cli(*args: str, cwd: Path = REPO_ROOT):
    return warm_python.run([sys.executable, "-m", "crate_clip.cli", *args], env=run_env(), cwd=cwd,
                           capture_output=True, text=True, timeout=600)


def _show(proc) -> str:
    return proc.stdout[-3000:] + proc.stderr[-3000:]


def _ours(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("crate-clip")]


def _users(ckpts: Path) -> dict:
    """The user's files among the checkpoints: all but the run's own, which its saves rewrite (the tags, `latest`,
    DeepSpeed's zero_to_fp32.py and zero_to_torch.py)."""
    return {k: v for k, v in snapshot(ckpts).items() if not k.startswith(("stage", "latest", "zero_to_"))}


def _real_dirs(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.is_dir() and not p.is_symlink())


@pytest.fixture(scope="module")
def finished(tmp_path_factory, tiny_fmnist):
    """(run folder, config file) of a finished 2-stage run that kept one checkpoint (keep_last=1)."""
    root = tmp_path_factory.mktemp("rotation")
    cfg = tiny_config(root / "run", tiny_fmnist, zero_stage=2, precision="fp32", stages=STAGES, every_steps=1,
                      evals=False, logging={"tensorboard": False, "plot": False})
    cfg["checkpoint"]["keep_last"] = 1
    config = write_config(cfg, root / "run.yaml")
    proc = _cli("train", "--config", str(config))
    assert proc.returncode == 0, _show(proc)
    return root / "run", config


def _copy(finished, tmp_path: Path) -> tuple[Path, list[str]]:
    """A copy of the finished run and the `--config ... --set run.output_dir=<copy>` that names it."""
    run, config = finished
    copy = shutil.copytree(run, tmp_path / "run", symlinks=True)
    return copy, ["--config", str(config), "--set", f"run.output_dir={copy}"]


def _doc_commands(tmp_path: Path, run: Path, test_images: Path) -> list[list[str]]:
    """docs/export.md's `crate-clip export` lines (its bash blocks) and its `crate-clip eval ... --pretrained`
    command, as written, with the docs' run folders (runs/my_run, runs/fashion_mnist_demo) linked to `run` in
    `tmp_path`, the stage-0 checkpoint it names replaced by the run's, and data/fmnist_wds by a small test set."""
    text = DOC.read_text()
    lines = [line.split("  #")[0].strip() for block in re.findall(r"```bash\n(.*?)```", text, re.S)
             for line in block.splitlines()]
    # `--weights ema` needs a run with train.ema: test_train_resume's EMA test runs it (tests/doc_commands.py)
    commands = [line for line in lines if line.startswith("crate-clip export") and "--weights ema" not in line]
    commands += re.findall(r"`(crate-clip eval [^`]*--pretrained [^`]*)`", text)
    assert len(commands) == 5, commands   # 3 + the hub export + the eval of a weights file
    (tmp_path / "runs").mkdir()
    for name in ("my_run", "fashion_mnist_demo"):
        (tmp_path / "runs" / name).symlink_to(run)
    commands = [re.sub(r"stage0-step\d{8}", STAGE0_END, c).replace("data/fmnist_wds", str(test_images))
                for c in commands]
    return [shlex.split(c)[1:] for c in commands]


def test_keep_last_1_keeps_each_stage_end_and_the_docs_export_commands_run_as_written(finished, tiny_fmnist,
                                                                                       tmp_path):
    run, _ = finished
    assert _real_dirs(run / "checkpoints") == [STAGE0_END, STAGE1_END]   # stage 0's end survived stage 1's saves
    for argv in _doc_commands(tmp_path, run, tiny_fmnist / "test"):
        proc = _cli(*argv, cwd=tmp_path)
        assert proc.returncode == 0, (argv, _show(proc))
        if argv[0] == "export":
            assert "verified: open_clip reloads the export with identical weights" in proc.stdout, _show(proc)
            # its progress: a plain line as each phase ends, on stderr (issue 42 item 2)
            phases = [line for line in proc.stderr.splitlines() if line.startswith("crate-clip export: ")]
            assert [p.split(" ")[2] for p in phases] == ["read", "wrote"], _show(proc)
            assert phases[0].endswith(" s") and "consolidated to fp32 weights" in phases[0], _show(proc)
        else:
            assert "zero-shot: top-1" in proc.stdout, _show(proc)

    def image_size(export: Path) -> int:
        return json.loads((export / "open_clip_config.json").read_text())["model_cfg"]["vision_cfg"]["image_size"]

    assert image_size(run / "exports" / STAGE0_END) == 16 and image_size(tmp_path / "exports" / "day3") == 16
    assert image_size(run / "exports" / STAGE1_END) == 28 and image_size(tmp_path / "exports" / "my_model") == 28
    proc = _cli("export", str(run), "--stage", "1", "--out", str(tmp_path / "stage1"), "--no-verify")
    assert proc.returncode == 0, _show(proc)
    weights = "open_clip_model.safetensors"
    assert (tmp_path / "stage1" / weights).read_bytes() == (run / "exports" / STAGE1_END / weights).read_bytes()


@pytest.mark.parametrize("keep_last", [1, 2])
def test_rotation_keeps_every_stage_end_whatever_keep_last(tmp_path, keep_last):
    """Records only (no weights): 3 stages of 3 steps, a checkpoint every step, rotated after each save."""
    from crate_clip.train.checkpointing.checkpoints import CheckpointManager

    root = tmp_path / "checkpoints"
    manager = CheckpointManager(root, keep_last=keep_last, rank=0, world_size=1)
    for global_step in range(1, 10):
        stage, step = (global_step - 1) // 3, (global_step - 1) % 3 + 1
        tag = f"stage{stage}-step{step:08d}"
        (root / tag).mkdir(parents=True)
        (root / tag / "crate_clip.json").write_text(json.dumps(
            {"stage_index": stage, "step": step, "stage_steps": 3, "global_step": global_step}))
        (root / "latest").write_text(tag)
        manager.prune()
    newest = [f"stage2-step{s:08d}" for s in range(4 - keep_last, 4)]
    assert _real_dirs(root) == sorted({"stage0-step00000003", "stage1-step00000003", *newest})


def test_leftovers_and_removable_copies_are_the_runs_own_only(tmp_path):
    """What a resume removes (interrupted saves and conversions) and names as removable (converted copies): only
    under the trainer's own names, never in a user's folder that happens to hold such a name."""
    from crate_clip.train.run.disk_space import leftovers, removable

    root = tmp_path / "checkpoints"
    for name in (".stage0-step00000002.saving", ".keep.saving", "stage0-step00000004/.universal.converting",
                 "stage0-step00000004/universal", "my-backup/.universal.converting", "my-backup/universal"):
        (root / name).mkdir(parents=True)
    assert leftovers(root) == [root / ".stage0-step00000002.saving", root / "stage0-step00000004/.universal.converting"]
    assert [line.split(" ")[0] for line in removable(root, None)] == ["stage0-step00000004/universal"]


def test_rotation_and_resume_remove_only_what_the_run_wrote(finished, tmp_path):
    """Resumed from stage 0's end (stage 1 is trained again: two saves, each rotating), with a user's folders and
    files in checkpoints/, two damaged checkpoints and an interrupted save of the run's own."""
    run, args = _copy(finished, tmp_path)
    ckpts = run / "checkpoints"
    other = shutil.copytree(finished[0] / "checkpoints" / STAGE1_END, tmp_path / "elsewhere" / STAGE1_END)
    (ckpts / "my-backup").mkdir()   # a user's copy of a checkpoint: a complete record, not under its own tag
    shutil.copy(ckpts / STAGE1_END / "crate_clip.json", ckpts / "my-backup")
    (ckpts / "my-backup" / ".universal.converting").mkdir()   # named as a killed conversion, but in a user's folder
    (ckpts / "my-backup" / ".universal.converting" / "keep.txt").write_text("mine")
    (ckpts / ".notes").mkdir()
    (ckpts / ".notes" / "todo.txt").write_text("compare with run 2")
    (ckpts / ".keep.saving").mkdir()   # a dot folder ending like a save's staging folder, not named as one
    (ckpts / ".keep.saving" / "a").write_text("a")
    (ckpts / "README.txt").write_text("checkpoints of the tiny run")
    (ckpts / "linked").symlink_to(other)   # a user's link to a checkpoint elsewhere: neither followed nor removed
    user_files = _users(ckpts)
    damaged_same_tag = ckpts / "stage1-step00000001"   # its tag is saved again: the swap must not delete it
    damaged_same_tag.mkdir()
    (damaged_same_tag / "crate_clip.json").write_text('{"stage_index": 1, "st')
    (damaged_same_tag / "mp_rank_00_model_states.pt").write_bytes(b"weights")
    no_record = ckpts / "stage0-step00000002"   # a checkpoint folder whose crate_clip.json is gone
    no_record.mkdir()
    (no_record / "mp_rank_00_model_states.pt").write_bytes(b"weights 2")
    interrupted = ckpts / ".stage1-step00000002.saving"   # the run's own interrupted save
    interrupted.mkdir()
    (interrupted / "mp_rank_00_model_states.pt").write_bytes(b"partial")

    proc = _cli("train", *args, "--resume", str(ckpts / STAGE0_END))
    assert proc.returncode == 0, _show(proc)
    out = proc.stdout.splitlines()
    assert f"[note] removed what interrupted writes left in {ckpts}: .stage1-step00000002.saving (0.1 MiB)" in out
    assert (f"[warn] checkpoint stage1-step00000001 is damaged (its crate_clip.json does not parse): moved to "
            f"{ckpts / 'stage1-step00000001.damaged'}, not deleted; remove it once you no longer need it") in out
    assert (f"[warn] checkpoint stage0-step00000002 is damaged (its crate_clip.json is missing): moved to "
            f"{ckpts / 'stage0-step00000002.damaged'}, not deleted; remove it once you no longer need it") in out
    assert _users(ckpts) == user_files
    assert (ckpts / "stage1-step00000001.damaged" / "mp_rank_00_model_states.pt").read_bytes() == b"weights"
    assert (ckpts / "stage0-step00000002.damaged" / "mp_rank_00_model_states.pt").read_bytes() == b"weights 2"
    assert _real_dirs(ckpts) == sorted([".keep.saving", ".notes", "my-backup", "stage0-step00000002.damaged",
                                        STAGE0_END, "stage1-step00000001.damaged", STAGE1_END])
    assert (ckpts / "latest").read_text() == STAGE1_END and (other / "crate_clip.json").is_file()


def test_a_resume_from_an_earlier_checkpoint_starts_a_line_that_rotation_latest_export_and_resume_follow(
        tmp_path, tiny_fmnist):
    """Line A: 3 + 3 steps at 16 px, a checkpoint every step, all kept. Line B resumes from A's step 1 with both
    stages made 2 steps long (allowed changes) and keep_last=2: A's stage0-step3 (the end of its longer stage 0) and
    stage1-step3 keep higher global steps than anything of B. Judged by the step, rotation would delete B's
    stage1-step1 (keeping A's two), and export --stage 0 and --resume latest without `latest` would take A's."""
    # in this process, the functions train calls (none imports DeepSpeed, whose import would change the environment
    # the warm commands share, tests/warm_python.py)
    from crate_clip.checkpoint_io.checkpoint_choice import RESUME, choose_checkpoint
    from crate_clip.train.checkpointing.checkpoints import CheckpointManager, intact_checkpoint
    from crate_clip.train.checkpointing.config_changes import resumed_at
    from crate_clip.train.checkpointing.elastic_resume import resolve_auto

    stages = [dict(STAGES[0]), dict(STAGES[0], name="more", samples=48)]   # 3 + 3 steps, all at 16 px (cheap)
    cfg = tiny_config(tmp_path / "run", tiny_fmnist, zero_stage=2, precision="fp32", stages=stages, every_steps=1,
                      evals=False, logging={"tensorboard": False, "plot": False})
    cfg["checkpoint"]["keep_last"] = 10
    cfg["data"]["num_workers"] = 0
    config, run, ckpts = write_config(cfg, tmp_path / "run.yaml"), tmp_path / "run", tmp_path / "run" / "checkpoints"
    line_a = _cli("train", "--config", str(config))
    assert line_a.returncode == 0, _show(line_a)
    tags = [f"stage{i}-step{s:08d}" for i in (0, 1) for s in (1, 2, 3)]
    assert _real_dirs(ckpts) == tags
    a_records = {tag: json.loads((ckpts / tag / "crate_clip.json").read_text()) for tag in tags}
    assert [a_records[t]["save_number"] for t in tags] == [1, 2, 3, 4, 5, 6]
    assert a_records[tags[-1]]["lineage"] == [{"tag": t, "save_number": n} for n, t in enumerate(tags[:-1], 1)]

    shorter = ["--set", "stages.0.samples=32", "--set", "stages.1.samples=32", "--set", "checkpoint.keep_last=2"]
    line_b = _cli("train", "--config", str(config), *shorter, "--resume", str(ckpts / tags[0]),
                  "--allow-change", "stages.0.samples", "--allow-change", "stages.1.samples")
    assert line_b.returncode == 0, _show(line_b)
    assert (f"[note] resuming from {tags[0]}, an earlier checkpoint than {', '.join(tags[1:])} (saved after it on "
            "another line of the run)") in line_b.stdout, _show(line_b)
    # B's line: stage0-step2 (the end of its 2-step stage 0), stage1-step1, stage1-step2 (its newest 2 and the stage
    # ends); step 1 rotated out; A's stage0-step3 and stage1-step3 stay, neither counted nor removed
    assert _real_dirs(ckpts) == ["stage0-step00000002", "stage0-step00000003", "stage1-step00000001",
                                 "stage1-step00000002", "stage1-step00000003"]
    assert json.loads((ckpts / "stage0-step00000003" / "crate_clip.json").read_text()) == a_records[tags[2]]
    assert json.loads((ckpts / "stage1-step00000003" / "crate_clip.json").read_text()) == a_records[tags[5]]
    b_head = json.loads((ckpts / "stage1-step00000002" / "crate_clip.json").read_text())
    assert (b_head["global_step"], b_head["save_number"]) == (4, 9)
    assert [e["tag"] for e in b_head["lineage"]] == ["stage0-step00000002", "stage1-step00000001"]
    assert (ckpts / "latest").read_text() == "stage1-step00000002"
    exported = _cli("export", str(run), "--stage", "0", "--out", str(tmp_path / "s0"), "--no-verify", "--json")
    assert exported.returncode == 0, _show(exported)
    assert json.loads(exported.stdout)["checkpoint"] == str(ckpts / "stage0-step00000002")

    (ckpts / "latest").unlink()   # lost: the line is found from the records, not from the steps
    manager = CheckpointManager(ckpts, keep_last=2, rank=0, world_size=1)
    assert resolve_auto(run, manager, "auto") == "latest"
    assert choose_checkpoint("latest", RESUME, run_checkpoints=ckpts).tag_dir == ckpts / "stage1-step00000002"
    # the run folder names the same one, for the resume and for its config-change check alike
    assert manager.resolve(str(run)) == ckpts / "stage1-step00000002"
    assert resumed_at(run, str(run)).checkpoint == resumed_at(run, "auto").checkpoint == "stage1-step00000002"
    with open(ckpts / "stage1-step00000002" / "mp_rank_00_model_states.pt", "ab") as f:
        f.write(b"x")   # damaged: --resume latest goes back along its line, to stage1-step1, not to A's
    assert intact_checkpoint(manager, ckpts / "stage1-step00000002", "latest") == ckpts / "stage1-step00000001"
    resumed = _cli("train", "--config", str(config), *shorter, "--resume", "auto")
    assert resumed.returncode == 0, _show(resumed)
    assert f"resuming from {ckpts / 'stage1-step00000001'} (stage 1, step 1" in resumed.stdout, _show(resumed)
    assert (ckpts / "latest").read_text() == "stage1-step00000002"   # saved again, whole
    assert _real_dirs(ckpts) == ["stage0-step00000002", "stage0-step00000003", "stage1-step00000001",
                                 "stage1-step00000002", "stage1-step00000003"]


def test_a_checkpoint_linked_to_another_runs_is_refused_by_resume_and_export(finished, tmp_path):
    run, args = _copy(finished, tmp_path)
    ckpts = run / "checkpoints"
    target = finished[0] / "checkpoints" / STAGE1_END
    link = ckpts / "stage1-step00000009"
    link.symlink_to(target)
    (ckpts / "latest").write_text(link.name)
    before = snapshot(run)

    resumed = _cli("train", *args, "--resume", "latest")
    assert resumed.returncode == 4, _show(resumed)
    assert _ours(resumed.stderr)[0] == (
        f"crate-clip train: --resume latest: {link} is a symbolic link to {target}, outside its run folder (another "
        f"run's checkpoint); fix: remove the link, or pass --resume {target} to continue from that checkpoint "
        "knowingly"), _show(resumed)
    assert "Traceback" not in resumed.stderr
    for named in (run, link):
        exported = _cli("export", str(named), "--out", str(tmp_path / "export"))
        assert exported.returncode == 2, _show(exported)
        assert _ours(exported.stderr)[0] == (
            f"crate-clip export: {link}: a symbolic link to {target}, outside its run folder (another run's "
            f"checkpoint); fix: export {target} itself, or remove the link"), _show(exported)
        assert "Traceback" not in exported.stderr and not (tmp_path / "export").exists()
    assert snapshot(run) == before   # nothing written, nothing removed

    # a whole checkpoints/ folder linked to another run's: refused in one line before anything is read or removed,
    # by the trainer (--resume latest) and by the launching process (--validate, as --nproc), and by export
    linking, theirs = tmp_path / "linking", finished[0] / "checkpoints"
    linking.mkdir()
    shutil.copy(finished[0] / "run_config.yaml", linking)
    (linking / "checkpoints").symlink_to(theirs)
    other, mine = snapshot(finished[0]), snapshot(linking)
    for extra in (["--resume", "latest"], ["--validate", "--resume", "auto"]):
        proc = _cli("train", "--config", str(finished[1]), "--set", f"run.output_dir={linking}", *extra)
        assert proc.returncode == 4, _show(proc)
        assert _ours(proc.stderr) == [
            f"crate-clip train: run.output_dir {linking}: checkpoints is a symbolic link to {theirs.resolve()}, outside "
            "the run folder (a run reads, rewrites and removes its own files there); fix: replace the link by a folder "
            "or file of this run's own (to keep a run on another disk, set run.output_dir there: the run folder itself "
            "may be a link)"], _show(proc)
    exported = _cli("export", str(linking), "--out", str(tmp_path / "export"))
    assert exported.returncode == 2 and _ours(exported.stderr)[0] == (
        f"crate-clip export: {linking / 'checkpoints'}: a symbolic link to {theirs.resolve()}, outside its run folder "
        f"(another run's checkpoints); fix: export {theirs.resolve()} itself, or replace the link by the run's own "
        "folder"), _show(exported)
    assert snapshot(finished[0]) == other and snapshot(linking) == mine and not (tmp_path / "export").exists()
