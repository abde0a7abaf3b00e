"""A pretrained text tower locked for training (the paper's CRATE-alpha-CLIPA setup): loading it from a
file / local-dir export / open_clip tag, the config keys and their errors, and 2-process ZeRO-2/3 runs where
only the image tower trains, the frozen tower is replicated (not partitioned) and comes back bit-identical."""
import json

import pytest
import torch

from train_fixtures import run_job, torchrun_cmd

MODEL = "CRATE-alpha-CLIPA-tiny"


def _text_source(path, seed=123):
    """A tiny CLIP checkpoint whose text tower and logit scale differ from a seed-0 model's."""
    from crate_clip.models import create_clip
    torch.manual_seed(seed)
    model = create_clip(MODEL, image_size=16, context_length=16)
    with torch.no_grad():
        model.logit_scale.fill_(2.5)
    torch.save(model.state_dict(), path)
    return model.state_dict()


# ---------------------------------------------------------------- multi-process runs
@pytest.fixture(scope="module")
def lock_probe(tmp_path_factory):
    out = tmp_path_factory.mktemp("lock")
    _text_source(out / "text.pt")
    proc = run_job(torchrun_cmd(2, "lock", str(out)), timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads((out / "lock.json").read_text())


def _rows(records, zs, precision, lock):
    rows = [r for r in records if (r["zero_stage"], r["precision"], r["lock"]) == (zs, precision, lock)]
    assert sorted(r["rank"] for r in rows) == [0, 1]
    return rows


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.parametrize("zs, precision", [(2, "bf16"), (2, "fp32"), (3, "bf16")])
def test_locked_text_tower_trains_only_the_image_tower(lock_probe, zs, precision):
    for r in _rows(lock_probe, zs, precision, True):
        assert r["losses"][-1] < r["losses"][0] - 0.1, r["losses"]  # the image tower learns the batch
        assert r["frozen_live_equal"]  # text tower and logit scale untouched by 8 steps
        assert r["text_requires_grad"] == []
        assert r["trained_names"] and all(n.startswith("visual.") for n in r["trained_names"])
    saved = _rows(lock_probe, zs, precision, True)[0]
    assert saved["saved_text_equal"]  # checkpoint -> zero_to_fp32: the fp32 source values, bit for bit
    assert "token_embedding.weight" in saved["saved_keys"] and "logit_scale" in saved["saved_keys"]


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.parametrize("zs", [2, 3])
def test_lock_keeps_text_out_of_optimizer_and_partitions(lock_probe, zs):
    locked, free = _rows(lock_probe, zs, "bf16", True), _rows(lock_probe, zs, "bf16", False)
    total, image = free[0]["param_numel_total"], locked[0]["param_numel_total"]
    assert image < total * 0.6  # the tiny model's text tower is about half of it
    for r in locked:
        # Adam moments and fp32 masters cover only this rank's half of the image tower
        assert r["master_numel"] == pytest.approx(image / 2, rel=0.02)
        assert r["optimizer_state_numel"] == pytest.approx(image, rel=0.02)
        # the frozen tower is replicated in full on every rank, in fp32, as buffers
        assert r["buffer_bytes"] >= (total - image) * 4
    for r in free:
        assert r["master_numel"] == pytest.approx(total / 2, rel=0.02)
    if zs == 3:  # ZeRO-3 partitions parameters: the locked run's are the image tower's only
        assert locked[0]["param_numel_local"] == pytest.approx(image / 2, rel=0.02)
    assert free[0]["saved_text_equal"] is False  # control: a trainable tower does move
