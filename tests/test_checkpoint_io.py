"""crate_clip.checkpoint_io: writes are durable before they are made visible (fsync of the data, then rename,
then fsync of the folder), and a checkpoint's files are on disk before `latest` names it."""
import json
import os
from pathlib import Path

import pytest

from crate_clip.checkpoint_io import atomic_files
from crate_clip.checkpoint_io.atomic_files import atomic_write_text, fsync_tree, replace_dir, restore_replaced


@pytest.fixture
def disk_events(monkeypatch):
    """Every fsync (by path) and rename, in order; both still do their real work."""
    events = []
    real_fsync, real_replace, real_rename = os.fsync, os.replace, os.rename

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst):
        events.append(("rename", str(src), str(dst)))
        return real_replace(src, dst)

    def rename(src, dst):
        events.append(("rename", str(src), str(dst)))
        return real_rename(src, dst)

    monkeypatch.setattr(atomic_files.os, "fsync", fsync)
    monkeypatch.setattr(atomic_files.os, "replace", replace)
    monkeypatch.setattr(atomic_files.os, "rename", rename)
    return events


def test_atomic_write_fsyncs_the_data_then_renames_then_fsyncs_the_folder(tmp_path, disk_events):
    atomic_write_text(tmp_path / "latest", "stage0-step00000002")
    assert (tmp_path / "latest").read_text() == "stage0-step00000002"
    (kind0, tmp), rename, fsync_dir = disk_events
    assert kind0 == "fsync" and Path(tmp).parent == tmp_path and Path(tmp).name.startswith(".latest.tmp")
    assert rename == ("rename", tmp, str(tmp_path / "latest")) and fsync_dir == ("fsync", str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest"]


def test_fsync_tree_reaches_every_file_and_folder(tmp_path, disk_events):
    (tmp_path / "a" / "b").mkdir(parents=True)
    for name in ("x.pt", "a/y.pt", "a/b/z.pt"):
        (tmp_path / name).write_bytes(b"1")
    fsync_tree(tmp_path)
    synced = {path for _, path in disk_events}
    assert synced == {str(tmp_path / p) for p in ("x.pt", "a/y.pt", "a/b/z.pt", "", "a", "a/b")} | {str(tmp_path)}


def test_replace_dir_keeps_the_old_folder_until_the_new_one_has_its_name(tmp_path):
    old, new = tmp_path / "stage0-step00000004", tmp_path / ".stage0-step00000004.saving"
    old.mkdir()
    (old / "f").write_text("old")
    new.mkdir()
    (new / "f").write_text("new")
    os.rename(old, tmp_path / ".stage0-step00000004.replaced")  # a swap cut short after its first rename
    assert restore_replaced(old) and (old / "f").read_text() == "old"
    replace_dir(new, old)
    assert (old / "f").read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == [old.name]


def test_checkpoint_commit_is_durable_before_latest_moves(tmp_path, disk_events):
    from crate_clip.train.checkpointing.checkpoints import CheckpointManager

    root = tmp_path / "checkpoints"
    staging = root / ".stage0-step00000002.saving"
    staging.mkdir(parents=True)
    (staging / "mp_rank_00_model_states.pt").write_bytes(b"weights")
    manager = CheckpointManager(root, keep_last=2, rank=0, world_size=1)
    manager.commit(staging, "stage0-step00000002", {"stage_index": 0, "step": 2, "global_step": 2})
    tag_dir = root / "stage0-step00000002"
    assert json.loads((tag_dir / "crate_clip.json").read_text())["step"] == 2
    assert (root / "latest").read_text() == "stage0-step00000002" and not staging.exists()
    latest_moved = next(i for i, e in enumerate(disk_events) if e[0] == "rename" and e[2] == str(root / "latest"))
    before = disk_events[:latest_moved]
    assert ("rename", str(staging), str(tag_dir)) in before  # the folder has its name ...
    assert ("fsync", str(root)) in before[before.index(("rename", str(staging), str(tag_dir))):]  # ... durably
    info_synced = [e for e in before if e[0] == "fsync" and Path(e[1]).parent == staging]
    assert info_synced and Path(info_synced[0][1]).name.startswith(".crate_clip.json.tmp")
