"""Two-process DeepSpeed runs under ZeRO 1, 2 and 3 (fp32 and bf16): each rank really holds about half the
optimizer state (and, under ZeRO-3, half the parameters), read from the engines; the partitioning does not
change the training math."""
import json

import pytest

from train_fixtures import ranks_cmd, run_job, tiny_clip_params

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    out = tmp_path_factory.mktemp("zero") / "zero.json"
    proc = run_job(ranks_cmd(2, "zero", str(out)), timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(out.read_text())


def _case(records, zs, precision):
    rows = [r for r in records if r["zero_stage"] == zs and r["precision"] == precision]
    assert sorted(r["rank"] for r in rows) == [0, 1]
    return rows


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("zs", [1, 2, 3])
def test_optimizer_state_is_partitioned(probe, zs, precision):
    rows = _case(probe, zs, precision)
    total = rows[0]["param_numel_total"]
    assert total == tiny_clip_params(16, 16)   # the probe's model: CRATE-alpha-CLIPA-tiny at 16 px, 16 tokens
    for r in rows:
        assert r["world_size"] == 2
        # Adam keeps exp_avg and exp_avg_sq for the fp32 master partition it owns: ~half the model each
        assert r["master_numel"] == pytest.approx(total / 2, rel=0.01)
        assert r["optimizer_state_numel"] == pytest.approx(total, rel=0.01)  # 2 moments x 1/2
    # the two partitions tile the model (DeepSpeed pads a little for alignment)
    assert total <= sum(r["master_numel"] for r in rows) <= total * 1.01


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_zero3_partitions_parameters(probe, precision):
    for zs in (1, 2):
        for r in _case(probe, zs, precision):
            assert r["param_numel_local"] == r["param_numel_total"]  # ZeRO 1/2 replicate the weights
    rows = _case(probe, 3, precision)
    total = rows[0]["param_numel_total"]
    for r in rows:
        assert r["param_numel_local"] == pytest.approx(total / 2, rel=0.01)
    itemsize = 4 if precision == "fp32" else 2
    zero1 = _case(probe, 1, precision)[0]
    assert rows[0]["param_bytes"] == pytest.approx(zero1["param_bytes"] / 2, rel=0.02)
    assert zero1["param_bytes"] == pytest.approx(total * itemsize, rel=0.01)


@pytest.mark.parametrize("zs", [2, 3])
def test_gradients_are_partitioned(probe, zs):
    """After backward each rank keeps only its half of the reduced fp32 gradients."""
    for r in _case(probe, zs, "fp32"):
        assert r["grad_bytes"] == pytest.approx(r["param_numel_total"] * 4 / 2, rel=0.02)


def test_partitioning_does_not_change_the_math(probe):
    """Same data, same seed: ZeRO 1, 2 and 3 give the same losses (fp32 tightly, bf16 loosely)."""
    for precision, tol in (("fp32", 1e-5), ("bf16", 2e-2)):
        ref = {r["rank"]: r["losses"] for r in _case(probe, 1, precision)}
        for zs in (2, 3):
            for r in _case(probe, zs, precision):
                assert r["losses"] == pytest.approx(ref[r["rank"]], rel=tol, abs=tol)
        assert all(l0 is not None for l0 in ref[0])
        assert ref[0][2] < ref[0][0]  # three steps on random pairs already lower the loss
