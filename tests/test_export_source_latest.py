"""The export reads a run's `latest` file as a resume does: bounded, a plain small file naming one folder of
checkpoints/. A FIFO (which would block an unbounded read), a huge file or a tag that walks out of the folder
("../elsewhere") is refused with a message naming the file, never followed."""
import os
from pathlib import Path

import pytest

from crate_clip.export.source import ExportSourceError, export_source


def _run_with_latest(tmp_path: Path) -> Path:
    ckpts = tmp_path / "run" / "checkpoints"
    ckpts.mkdir(parents=True)
    return ckpts


def test_a_latest_naming_a_folder_outside_the_checkpoints_is_refused(tmp_path):
    ckpts = _run_with_latest(tmp_path)
    (ckpts / "latest").write_text("../../elsewhere")
    with pytest.raises(ExportSourceError, match="latest: not one checkpoint folder's name"):
        export_source(tmp_path / "run")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this platform")
def test_a_latest_that_is_a_fifo_is_refused_without_blocking(tmp_path):
    ckpts = _run_with_latest(tmp_path)
    os.mkfifo(ckpts / "latest")
    with pytest.raises(ExportSourceError, match="latest: .*FIFO"):
        export_source(tmp_path / "run")


def test_a_huge_latest_is_refused(tmp_path):
    ckpts = _run_with_latest(tmp_path)
    with open(ckpts / "latest", "wb") as f:
        f.truncate(1 << 30)   # sparse: 1 GiB of size, no disk used
    with pytest.raises(ExportSourceError, match="latest: .*bytes"):
        export_source(tmp_path / "run")


def test_a_latest_naming_an_incomplete_checkpoint_is_refused(tmp_path):
    ckpts = _run_with_latest(tmp_path)
    (ckpts / "stage1-step00000002").mkdir()
    (ckpts / "latest").write_text("stage1-step00000002\n")
    with pytest.raises(ExportSourceError, match="not a complete checkpoint"):
        export_source(tmp_path / "run")


def test_a_latest_that_is_a_dangling_link_is_named_so(tmp_path):
    ckpts = _run_with_latest(tmp_path)
    (ckpts / "latest").symlink_to(tmp_path / "gone")
    with pytest.raises(ExportSourceError, match="latest: a link to nothing"):
        export_source(tmp_path / "run")
