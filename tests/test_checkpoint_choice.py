"""crate_clip.checkpoint_io.checkpoint_choice, the one decision of which checkpoint a user's words mean: each form its
table lists names the same checkpoint for every use that accepts it, and the uses differ only where its docstring
says (a stale `latest`, a run folder for eval)."""
import json
from pathlib import Path

import pytest

from crate_clip.checkpoint_io.checkpoint_choice import (BY_AUTO, BY_FOLDER, BY_LATEST, BY_STAGE, BY_TAG, EVAL, EXPORT,
                                                        PLAN, RESUME, choose_checkpoint)


def _checkpoint(ckpts: Path, tag: str, step: int, complete: bool = True) -> Path:
    """A tag folder with DeepSpeed's model-states file and, when `complete`, its crate_clip.json (stage 0 of 2
    steps)."""
    folder = ckpts / tag
    folder.mkdir(parents=True)
    (folder / "mp_rank_00_model_states.pt").write_bytes(b"")
    if complete:
        (folder / "crate_clip.json").write_text(json.dumps(
            {"model_name": "m", "stage_index": 0, "step": step, "global_step": step, "stage_steps": 2,
             "save_number": step, "lineage": [{"tag": f"stage0-step{s:08d}", "save_number": s}
                                              for s in range(1, step)]}))
    return folder


def test_every_use_names_the_same_checkpoint_by_the_same_words_and_differs_only_where_documented(tmp_path):
    run = tmp_path / "run"
    ckpts = run / "checkpoints"
    first, final = _checkpoint(ckpts, "stage0-step00000001", 1), _checkpoint(ckpts, "stage0-step00000002", 2)
    (ckpts / "latest").write_text(final.name)

    # the run's own words (train --resume): `latest`, and `auto` that also starts afresh in an empty run
    latest = choose_checkpoint("latest", RESUME, run_checkpoints=ckpts)
    assert (latest.tag_dir, latest.named_by, latest.complete) == (final, BY_LATEST, True)
    assert choose_checkpoint("auto", RESUME, run_checkpoints=ckpts).named_by == BY_AUTO
    empty = choose_checkpoint("auto", RESUME, run_checkpoints=tmp_path / "none")
    assert (empty.tag_dir, empty.complete) == (None, False)
    with pytest.raises(ValueError, match="--resume latest: no complete checkpoint in"):
        choose_checkpoint("latest", RESUME, run_checkpoints=tmp_path / "none")

    # a run folder, its checkpoints folder, a tag folder: one answer for every use that takes the form (a run folder
    # is now taken by train --resume too, as plan, the config-change check and export took it)
    for named, by in ((run, BY_FOLDER), (ckpts, BY_FOLDER), (first, BY_TAG)):
        uses = (RESUME, PLAN, EXPORT) + ((EVAL,) if named != run else ())
        answers = {use: choose_checkpoint(named, use) for use in uses}
        assert {(c.tag_dir, c.named_by) for c in answers.values()} == {(first if by == BY_TAG else final, by)}, answers
    assert choose_checkpoint(run, EXPORT, stage=0).named_by == BY_STAGE
    assert choose_checkpoint(ckpts, EVAL, tag=first.name).tag_dir == first

    # a stale `latest` (naming a save with no crate_clip.json): a resume and plan take the one saved last, an export
    # refuses it, eval follows it (DeepSpeed's files are enough for a checkpoint from elsewhere)
    stale = _checkpoint(ckpts, "stage0-step00000003", 3, complete=False)
    (ckpts / "latest").write_text(stale.name)
    assert choose_checkpoint(ckpts, RESUME).tag_dir == choose_checkpoint(ckpts, PLAN).tag_dir == final
    with pytest.raises(ValueError, match="names 'stage0-step00000003', which is not a complete checkpoint"):
        choose_checkpoint(ckpts, EXPORT)
    followed = choose_checkpoint(ckpts, EVAL)
    assert (followed.tag_dir, followed.complete) == (stale, False)

    # refusals keep their callers' words: a tag folder without its record, a folder without checkpoints
    with pytest.raises(ValueError, match=r"--resume .*: not a complete checkpoint \(no crate_clip.json: missing"):
        choose_checkpoint(stale, RESUME)
    with pytest.raises(ValueError, match="no complete checkpoint \\(crate_clip.json\\) there; fix: pass a run folder"):
        choose_checkpoint(tmp_path / "elsewhere", PLAN)
    with pytest.raises(FileNotFoundError, match="is not a DeepSpeed checkpoint folder"):
        choose_checkpoint(run, EVAL)


def test_a_checkpoint_linked_from_another_run_is_refused_by_resume_and_plan_alike(tmp_path):
    theirs = _checkpoint(tmp_path / "other" / "checkpoints", "stage0-step00000001", 1)
    ckpts = tmp_path / "run" / "checkpoints"
    ckpts.mkdir(parents=True)
    (ckpts / theirs.name).symlink_to(theirs)
    (ckpts / "latest").write_text(theirs.name)
    for use in (RESUME, PLAN):
        with pytest.raises(ValueError, match="is a symbolic link to .*outside its run folder"):
            choose_checkpoint(tmp_path / "run", use)
    with pytest.raises(ValueError, match="a symbolic link to .*outside its run folder"):
        choose_checkpoint(ckpts / theirs.name, EXPORT)
