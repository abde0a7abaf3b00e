"""The evaluation loop the tasks share (crate_clip/eval/eval_loop.py): the model is in eval mode for the pass and
back in its own mode after it, also when the pass fails; a rank's unreadable files are collected."""
import pytest
import torch
from PIL import Image

from crate_clip.eval.eval_datasets import classification_dataset
from crate_clip.eval.eval_loop import EvalPass, evaluation_mode


def test_evaluation_mode_restores_the_mode_also_on_an_error():
    model = torch.nn.Linear(2, 2)
    with evaluation_mode(model):
        assert not model.training
    assert model.training
    with pytest.raises(RuntimeError, match="boom"), evaluation_mode(model):
        raise RuntimeError("boom")
    assert model.training
    model.eval()
    with evaluation_mode(model):
        pass
    assert not model.training


def test_a_pass_yields_readable_batches_in_eval_mode_and_counts_the_unreadable(tmp_path):
    for label in ("a", "b"):
        (tmp_path / label).mkdir()
        for i in range(3):
            Image.new("RGB", (8, 8), (40 * i, 0, 0)).save(tmp_path / label / f"{i}.png")
    (tmp_path / "b" / "bad.png").write_bytes(b"not a png")
    dataset = classification_dataset(str(tmp_path), lambda im: torch.zeros(3, 8, 8), dataset="two",
                                     num_classes=2, classnames=["a", "b"])
    model, modes, idle = torch.nn.Linear(2, 2), [], []
    batches = EvalPass(model, dataset, batch_size=2, desc="test", progress=False, idle=lambda: idle.append(1))
    n = 0
    for batch in batches:
        modes.append(model.training)
        n += len(batch.images)
    assert n == 6 and modes and not any(modes) and model.training
    assert [p.rsplit("/", 1)[-1] for p in batches.unreadable] == ["bad.png"]
