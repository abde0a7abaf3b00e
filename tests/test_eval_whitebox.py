"""White-box diagnostics: coding rate against a direct numpy computation, sparsity counts, the tower hook."""
import numpy as np
import pytest
import torch

from crate_clip.models import CrateAlpha
from crate_clip.eval.whitebox import coding_rate, layer_diagnostics, zero_fraction


def _numpy_coding_rate(z: np.ndarray, eps2: float) -> float:
    """R^c of one sample, (h, N, p), written out head by head."""
    total = 0.0
    for head in z:
        n, p = head.shape
        zk = (head / np.linalg.norm(head, axis=1, keepdims=True)).T       # p x N, unit-norm columns
        total += np.linalg.slogdet(np.eye(p) + p / (n * eps2) * zk @ zk.T)[1]
    return 0.5 * total


def test_coding_rate_matches_numpy():
    rng = np.random.default_rng(0)
    z = rng.normal(size=(3, 2, 7, 5))  # B=3, h=2 heads, N=7 tokens, p=5
    z[1, :, :, :] = z[1, :, :1, :] * rng.uniform(0.5, 2.0, size=(2, 7, 1))  # sample 1: all tokens collinear
    got = coding_rate(torch.from_numpy(z), eps2=0.01).numpy()
    want = [_numpy_coding_rate(z[b], 0.01) for b in range(3)]
    np.testing.assert_allclose(got, want, rtol=1e-10)
    # collinear tokens (after normalisation: the same point) compress best: rank 1 per head
    assert got[1] < got[0] and got[1] == pytest.approx(2 * 0.5 * np.log(1 + 5 / 0.01), rel=1e-9)


def test_zero_fraction_counts():
    codes = torch.zeros(2, 4, 5)
    codes[0, :2] = 1.0           # 10 of 20 non-zero
    codes[1, 0, 0] = 3.0         # 1 of 20
    codes[1, 3, 4] = 1e-30       # tiny but not exactly zero
    assert zero_fraction(codes).tolist() == pytest.approx([0.5, 18 / 20])


def test_masked_coding_rate_and_sparsity_count_only_the_kept_tokens():
    """A mask (a caption's own tokens) gives each sample the numbers of its kept tokens alone, N included."""
    torch.manual_seed(0)
    z, codes = torch.randn(3, 2, 9, 4, dtype=torch.float64), torch.relu(torch.randn(3, 9, 6))
    mask = torch.zeros(3, 9, dtype=torch.bool)
    for b, kept in enumerate(([0, 1, 2], [0, 3, 4, 5, 8], list(range(9)))):
        mask[b, kept] = True
    rates, zeros = coding_rate(z, mask=mask), zero_fraction(codes, mask=mask)
    for b in range(3):
        kept = mask[b]
        torch.testing.assert_close(rates[b], coding_rate(z[b:b + 1, :, kept])[0], rtol=1e-12, atol=0)
        assert zeros[b] == pytest.approx(float(zero_fraction(codes[b:b + 1, kept])[0]), abs=1e-7)
    assert torch.equal(coding_rate(z, mask=torch.ones(3, 9, dtype=torch.bool)), coding_rate(z))


def test_layer_diagnostics_on_a_tower():
    torch.manual_seed(0)
    tower = CrateAlpha(img_size=16, patch_size=4, embed_dim=32, depth=3, num_heads=4, num_classes=0).eval()
    images = torch.randn(5, 3, 16, 16)
    out = tower.forward_intermediates(images, intermediates_only=True, return_projections=True,
                                      return_sparse_codes=True)
    assert [p.shape for p in out["projections"]] == [(5, 4, 17, 8)] * 3
    # the projections are U_k^T LN(Z) of each block's input
    t, _ = tower._embed(images)
    torch.testing.assert_close(out["projections"][0], tower.blocks[0].attn.project(tower.blocks[0].norm1(t)))
    d = layer_diagnostics(tower, images)
    assert len(d["coding_rate"]) == 3 and all(np.isfinite(d["coding_rate"]))
    want = coding_rate(out["projections"][2])
    assert d["coding_rate"][2] == pytest.approx(float(want.mean()), rel=1e-6)
    assert d["coding_rate_std"][2] == pytest.approx(float(want.std(unbiased=False)), rel=1e-6)
    zeros = zero_fraction(out["sparse_codes"][1])
    assert d["zero_fraction"][1] == pytest.approx(float(zeros.mean())) and 0 < d["zero_fraction"][1] < 1
    assert d["l0"][1] == pytest.approx(1 - d["zero_fraction"][1])


def test_layer_diagnostics_refuses_other_towers():
    with pytest.raises(TypeError, match="no CRATE-alpha tower"):
        layer_diagnostics(torch.nn.Linear(3, 3), torch.zeros(1, 3))


@pytest.mark.parametrize("patch", [4, 7])
def test_zero3_shadow_tower_follows_the_stage_patch_size(patch):
    """The probe's plain copy of a ZeRO-3 tower takes the trained tower's weights also after a stage changed
    the patch size (a stage's `patch_size`), and then computes what the trained tower computes."""
    from crate_clip.models import create_clip
    from crate_clip.train.run.run_config import config_from_dict
    from crate_clip.train.stage_setup.stage_model import resolve_stage
    from crate_clip.train.reporting.whitebox_log import shadow_towers
    from crate_clip.eval.whitebox import find_crate_tower

    torch.manual_seed(0)
    trained = find_crate_tower(create_clip("CRATE-alpha-CLIPA-tiny", image_size=28, context_length=16)).eval()
    trained.set_patch_size(patch)
    cfg = config_from_dict({"data": {"sources": ["x"]}, "stages": [
        {"image_size": 28, "context_length": 16, "samples": 256, "patch_size": patch}]}, check_paths=False)
    shadow = shadow_towers(resolve_stage(cfg, 0), trained, None)[0].eval()
    shadow.load_state_dict(trained.state_dict())   # strict: every shape must match
    images = torch.randn(2, 3, 28, 28)
    assert layer_diagnostics(shadow, images) == layer_diagnostics(trained, images)   # exact: same tower, same weights
