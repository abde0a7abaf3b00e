"""Exact contrastive gradient accumulation (feature cache) on 2 ranks under ZeRO 1/2/3 (also with a CRATE-alpha text
tower). The skip of a step whose loss is finite but whose gradient is not: test_train_nonfinite.py."""
import json
import math

import pytest

from train_fixtures import ranks_cmd, run_job

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]


def _probe(tmp_path_factory, mode):
    out = tmp_path_factory.mktemp(mode) / f"{mode}.json"
    proc = run_job(ranks_cmd(2, mode, str(out)), timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def accum(tmp_path_factory):
    return _probe(tmp_path_factory, "accum")


def test_k4_equals_k1_gradients_and_weights(accum):
    assert len(accum) == 10  # 5 cases x 2 ranks
    assert {r["model"] for r in accum} == {"CRATE-alpha-CLIPA-tiny", "CRATE-alpha-CLIPA-tiny-crate-text"}
    for row in accum:
        case = f"{row['model']} ZeRO-{row['zero_stage']} frozen_text={row['frozen_text']} rank {row['rank']}"
        assert row["k"] == [1, 4], case
        assert row["n_grads"][0] == row["n_grads"][1] > 0, case
        assert row["grad_max_abs"] > 1e-4, case  # real gradients, not zeros
        assert row["grad_max_diff"] <= 1e-5, case
        assert row["weight_moved"] > 1e-4, case  # the step happened
        assert row["weight_max_diff"] <= 1e-5, case
        assert math.isclose(row["loss"][0], row["loss"][1], rel_tol=1e-6), case
        assert math.isclose(row["grad_norm"][0], row["grad_norm"][1], rel_tol=1e-5), case


def test_frozen_text_tower_trains_only_the_rest(accum):
    frozen = [r for r in accum if r["frozen_text"]]
    full = [r for r in accum if not r["frozen_text"] and r["zero_stage"] == 2]
    assert frozen and full
    assert frozen[0]["n_grads"][0] < full[0]["n_grads"][0]
