"""The evaluations a training run declares: a refusal ends the job with one line from rank 0 (exit code 2); the
white-box probe reads its images from the first eval set with that set's class names, as the evaluation does.
End to end (a refused evaluation after a stage, then the resume that runs it): test_train_run_safety.py."""
from __future__ import annotations

import pytest
from PIL import Image


def test_a_refused_evaluation_is_said_once_per_job(monkeypatch, capsys):
    from crate_clip.core.errors import EXIT_CONFIG, report_error
    from crate_clip.train.loop.stage_evals import EvalRefusedError

    error = EvalRefusedError("stage 0 (low) evaluation at 16 px: /data/val: none of its 50 images could be read")
    monkeypatch.setenv("RANK", "1")   # every rank raises it: only rank 0 says it
    assert report_error("crate-clip train", error) == EXIT_CONFIG and capsys.readouterr().err == ""
    monkeypatch.setenv("RANK", "0")
    assert report_error("crate-clip train", error) == EXIT_CONFIG
    assert capsys.readouterr().err == f"crate-clip train: {error}\n"


def _folder_set(root, folders: list[str], classnames: list[str]):
    for name in folders:
        (root / name).mkdir(parents=True)
        Image.new("RGB", (20, 20), (30 * len(name), 90, 140)).save(root / name / "0.png")
    (root / "classnames.txt").write_text("\n".join(classnames) + "\n")


def test_the_whitebox_probe_matches_class_folders_by_name(tmp_path):
    """Folders are matched to the eval's class names (never taken in sort order): a folder that names no class is
    an error naming it, as in the evaluation itself."""
    from crate_clip.models import create_clip
    from crate_clip.train.run.run_config import config_from_dict
    from crate_clip.train.reporting.whitebox_log import _probe_images

    def probe(root):
        cfg = config_from_dict({"data": {"sources": ["/data/{00000000..00000009}.tar"]},
                                "stages": [{"name": "s", "image_size": 16, "samples": 8, "global_batch": 8}],
                                "eval": {"evals": [{"name": "pets", "dataset": "pets", "data": str(root)}]}},
                               check_paths=False)
        return _probe_images(cfg, 16, create_clip("CRATE-alpha-CLIPA-tiny", image_size=16), 2)

    _folder_set(tmp_path / "named", ["Dog", "cat"], ["dog", "cat"])   # sorted order differs from the class order
    assert tuple(probe(tmp_path / "named").shape) == (2, 3, 16, 16)
    _folder_set(tmp_path / "foreign", ["cat", "purse"], ["dog", "cat"])
    with pytest.raises(ValueError, match=r"folders 'purse' match no class name"):
        probe(tmp_path / "foreign")
