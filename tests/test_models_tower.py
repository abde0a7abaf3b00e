"""The CRATE-alpha / CRATE tower: equations, init, resolutions, masks, checkpointing, intermediates."""
import math

import pytest
import timm
import torch
import torch.nn.functional as F
from timm.layers import resample_abs_pos_embed

import crate_clip  # noqa: F401
from crate_clip.models import CrateAlpha
from crate_clip.models.token_masks import kept_patch_indices, num_kept_tokens
from models_fixtures import TINY


def tiny(name="crate_alpha_base_patch16_224", **kw):
    torch.manual_seed(0)
    return timm.create_model(name, **{**TINY, **kw})


@pytest.mark.parametrize("name,size", [("crate_alpha_base_patch16_224", 224), ("crate_alpha_base_patch16_224", 84),
                                       ("crate_alpha_large_patch14_224", 84), ("crate_alpha_base_patch8_224", 40),
                                       ("crate_base_patch16_224", 64)])
def test_forward_backward_several_resolutions(name, size):
    model = tiny(name, img_size=size, num_classes=5)
    x = torch.randn(2, 3, size, size)
    out = model(x)
    assert out.shape == (2, 5)
    out.square().sum().backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert missing == []


def test_gradients_reach_U_Wout_D_D1():
    model = tiny(num_classes=3, img_size=32)
    model(torch.randn(2, 3, 32, 32)).sum().backward()
    blk = model.blocks[0]
    for p in (blk.attn.qkv.weight, blk.attn.proj.weight, blk.ista.D, blk.ista.D1):
        assert p.grad is not None and p.grad.abs().sum() > 0


def test_block_matches_spec_equations():
    model = tiny(img_size=32).eval()
    blk, d, h = model.blocks[0], 32, 2
    t = torch.randn(2, 5, d)
    y = F.layer_norm(t, (d,), blk.norm1.weight, blk.norm1.bias, 1e-6)
    U, W_out = blk.attn.qkv.weight.t(), blk.attn.proj.weight.t()
    w = (y @ U).reshape(2, 5, h, d // h).transpose(1, 2)
    a = torch.softmax(w @ w.transpose(-1, -2) / math.sqrt(d // h), -1)
    t1 = t + (a @ w).transpose(1, 2).reshape(2, 5, d) @ W_out
    y = F.layer_norm(t1, (d,), blk.norm2.weight, blk.norm2.bias, 1e-6)
    D, D1 = blk.ista.D, blk.ista.D1
    z1 = F.relu(0.1 * (y @ D) - 0.01)
    z2 = F.relu(z1 - 0.1 * ((z1 @ D.t() - y) @ D) - 0.01)
    torch.testing.assert_close(blk(t), t1 + z2 @ D1.t(), rtol=1e-5, atol=1e-5)


def test_original_crate_ista_form_and_no_residual():
    model = tiny("crate_base_patch16_224", img_size=32).eval()
    blk, d = model.blocks[0], 32
    assert blk.ista.D.shape == (d, d) and blk.ista.D1 is None and blk.attn.proj.bias is not None
    assert blk.norm1.eps == 1e-5 and model.norm.eps == 1e-5
    t = torch.randn(2, 5, d)
    t1 = t + blk.attn(blk.norm1(t))[0]
    y = blk.norm2(t1)
    D = blk.ista.D
    expected = F.relu(y + 0.1 * (y @ D - (y @ D.t()) @ D) - 0.01)  # replaces t: no residual
    torch.testing.assert_close(blk(t), expected, rtol=1e-5, atol=1e-5)


def test_layernorm_eps_and_jax_init():
    model = timm.create_model("crate_alpha_base_patch16_224", embed_dim=256, depth=2, num_heads=4)
    assert all(m.eps == 1e-6 for m in model.modules() if isinstance(m, torch.nn.LayerNorm))
    conv = model.patch_embed.proj.weight
    bound = math.sqrt(6 / (3 * 16 * 16))
    assert conv.abs().max() <= bound and conv.abs().max() > 0.9 * bound  # kaiming-uniform bound
    assert model.patch_embed.proj.bias.abs().sum() == 0
    assert model.cls_token.std() < 1e-5
    assert abs(model.pos_embed.std().item() - 0.02) < 0.002
    blk = model.blocks[0]
    assert abs(blk.attn.qkv.weight.std().item() - 0.02) < 0.002
    assert abs(blk.attn.proj.weight.std().item() - 0.02) < 0.002
    dbound = math.sqrt(6 / 256)
    for D in (blk.ista.D, blk.ista.D1):
        assert D.shape == (256, 1024) and D.abs().max() <= dbound and D.abs().max() > 0.99 * dbound
    assert abs(model.head.weight.std().item() - 0.02) < 0.002 and model.head.bias.abs().sum() == 0
    assert {"cls_token", "pos_embed", "blocks.0.ista.D", "blocks.1.ista.D1"} <= model.no_weight_decay()


def test_sdpa_matches_plain_attention():
    sdpa = tiny(img_size=32).eval()
    plain = tiny(img_size=32, attn_impl="math").eval()
    plain.load_state_dict(sdpa.state_dict())
    x = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(sdpa(x), plain(x), rtol=1e-5, atol=1e-5)


def test_valid_conv_drops_the_remainder():
    model = tiny(img_size=84).eval()   # /16 -> 5x5 grid, 4 px dropped
    assert model.grid_size == (5, 5) and model.pos_embed.shape[1] == 26
    x = torch.randn(1, 3, 84, 84)
    cropped = x.clone()
    cropped[..., 80:, :] = 0
    cropped[..., :, 80:] = 0
    torch.testing.assert_close(model(x), model(cropped))


def test_wrong_input_size_error_and_dynamic_size():
    model = tiny(img_size=32).eval()
    with pytest.raises(ValueError, match="set_input_size"):
        model(torch.randn(1, 3, 64, 64))
    dyn = tiny(img_size=32, dynamic_img_size=True).eval()
    assert dyn(torch.randn(1, 3, 64, 64)).shape == (1, 1000)


def test_set_input_size_same_size_changes_nothing():
    model = tiny(img_size=48).eval()
    x = torch.randn(2, 3, 48, 48)
    before, pos = model(x), model.pos_embed.detach().clone()
    model.set_input_size(48)
    assert torch.equal(model.pos_embed, pos)
    assert torch.equal(model(x), before)


def test_set_input_size_resamples_2d_with_cls_apart():
    model = tiny(img_size=32).eval()   # 2x2 grid
    old = model.pos_embed.detach().clone()
    model.set_input_size(64)           # 4x4 grid
    new = model.pos_embed.detach()
    assert new.shape == (1, 17, 32) and model.grid_size == (4, 4)
    assert torch.equal(new[:, 0], old[:, 0])
    grid = old[:, 1:].reshape(1, 2, 2, 32).permute(0, 3, 1, 2)
    expected = F.interpolate(grid, size=(4, 4), mode="bicubic", align_corners=False, antialias=True)  # timm default
    torch.testing.assert_close(new[:, 1:], expected.permute(0, 2, 3, 1).reshape(1, 16, 32))
    assert model(torch.randn(1, 3, 64, 64)).shape == (1, 1000)


def test_grad_checkpointing_same_output_and_grads():
    model = tiny(img_size=32, num_classes=4)
    x = torch.randn(2, 3, 32, 32)
    model(x).sum().backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model.set_grad_checkpointing(True)
    model(x).sum().backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref[n], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind,ratio,expected", [("random", 0.5, 8), ("random", 0.3, 11), ("grid", 0.0, 4),
                                                 ("block", 0.75, 4), ("none", 0.0, 16)])
def test_masks_keep_expected_tokens_in_training_only(kind, ratio, expected):
    model = tiny(img_size=64, token_mask=kind, token_drop_ratio=ratio)  # 4x4 grid
    x = torch.randn(3, 3, 64, 64)
    model.train()
    assert model.forward_features(x).shape == (3, 1 + expected, 32)
    model.eval()
    assert model.forward_features(x).shape == (3, 17, 32)


def test_mask_indices_structure_and_cls_kept():
    torch.manual_seed(1)
    grid = (7, 7)
    idx = kept_patch_indices("grid", 4, grid, 0.0, torch.device("cpu"))
    assert idx.shape == (4, 16) == (4, num_kept_tokens("grid", grid, 0.0))
    for row in idx:   # exactly one kept patch per 2x2 window (edge windows are 1 wide)
        windows = {(int(i) // 7 // 2, int(i) % 7 // 2) for i in row}
        assert len(windows) == 16
    idx = kept_patch_indices("block", 4, (8, 8), 0.75, torch.device("cpu"))
    for row in idx:   # a contiguous 4x4 rectangle
        r, c = row // 8, row % 8
        assert (r.max() - r.min(), c.max() - c.min(), row.numel()) == (3, 3, 16)
    idx = kept_patch_indices("random", 4, (8, 8), 0.25, torch.device("cpu"))
    assert all(row.unique().numel() == 48 for row in idx)
    # class token survives the mask: compare embeddings before the blocks
    model = tiny(img_size=64, token_mask="random", token_drop_ratio=0.5, depth=0).train()
    x = torch.randn(2, 3, 64, 64)
    tokens, _ = model._embed(x)
    masked = model.forward_features(x)
    torch.testing.assert_close(masked[:, 0], model.norm(tokens)[:, 0])


def test_set_token_mask_and_bad_values():
    model = tiny(img_size=64).train()
    model.set_token_mask("block", 0.75)
    assert model.forward_features(torch.randn(1, 3, 64, 64)).shape[1] == 5
    with pytest.raises(ValueError, match="token_mask"):
        model.set_token_mask("checker")
    with pytest.raises(ValueError, match="drop_ratio"):
        model.set_token_mask("random", 1.0)


def test_forward_intermediates_with_attention_and_codes():
    model = tiny(img_size=48, depth=3).eval()  # 3x3 grid, L = 10
    x = torch.randn(2, 3, 48, 48)
    final, inter = model.forward_intermediates(x)
    assert len(inter) == 3 and inter[0].shape == (2, 32, 3, 3)
    torch.testing.assert_close(model.forward_head(final), model(x))
    only = model.forward_intermediates(x, indices=[0, 2], output_fmt="NLC", intermediates_only=True)
    assert [t.shape for t in only] == [(2, 9, 32)] * 2
    out = model.forward_intermediates(x, indices=2, return_attn=True, return_sparse_codes=True)
    assert len(out["attn"]) == 2 and out["attn"][0].shape == (2, 2, 10, 10)
    torch.testing.assert_close(out["attn"][0].sum(-1), torch.ones(2, 2, 10))
    codes = out["sparse_codes"]
    assert codes[0].shape == (2, 10, 128) and (codes[0] >= 0).all() and (codes[0] == 0).any()
    # the returned code is the one the block decodes: block(x) = x + attn + code @ D1^T
    blk = model.blocks[1]
    t, _ = model._embed(x)
    t = model.blocks[0](t)
    t_attn = t + blk.attn(blk.norm1(t))[0]
    torch.testing.assert_close(blk(t), t_attn + codes[0] @ blk.ista.D1.t(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out["final"], final)


def test_features_only_through_timm():
    model = timm.create_model("crate_alpha_base_patch16_224", features_only=True, out_indices=(0, 1),
                              img_size=32, **TINY)
    feats = model(torch.randn(1, 3, 32, 32))
    assert [f.shape for f in feats] == [(1, 32, 2, 2)] * 2


@pytest.mark.parametrize("decoupled,residual", [(False, False), (True, False), (True, True)])
def test_ablation_ladder_blocks_follow_their_equations(decoupled, residual):
    # +overcomplete (tied D, no residual) -> +decoupled (D1) -> +residual (= CRATE-alpha)
    model = CrateAlpha(img_size=32, embed_dim=16, depth=1, num_heads=2, overcomplete_ratio=4,
                       decoupled_dictionary=decoupled, ista_residual=residual).eval()
    blk = model.blocks[0]
    t = torch.randn(2, 5, 16)
    t1 = t + blk.attn(blk.norm1(t))[0]
    y, D = blk.norm2(t1), blk.ista.D
    z1 = F.relu(0.1 * (y @ D) - 0.01)
    z2 = F.relu(z1 - 0.1 * ((z1 @ D.t() - y) @ D) - 0.01)
    out = z2 @ (blk.ista.D1 if decoupled else D).t()
    torch.testing.assert_close(blk(t), t1 + out if residual else out, rtol=1e-5, atol=1e-5)


def test_drop_path_and_bf16():
    model = tiny(img_size=32, drop_path_rate=0.2, num_classes=3).train()
    model(torch.randn(2, 3, 32, 32)).sum().backward()
    assert model.blocks[1].ista.D1.grad.abs().sum() > 0
    model = tiny(img_size=32, num_classes=3).eval()
    x = torch.randn(2, 3, 32, 32)
    ref = model(x)
    out = model.to(torch.bfloat16)(x.to(torch.bfloat16))
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, rtol=0.1, atol=0.1)


def test_timm_conventions_classifier_name_device_and_dtype():
    for name in timm.list_models("crate*"):
        cfg = timm.models.get_pretrained_cfg(name)
        assert cfg.classifier == ("head" if cfg.num_classes else None), name
    model = timm.create_model("crate_alpha_base_patch16_224", device="meta", dtype=torch.bfloat16, **TINY)
    assert {(p.device.type, p.dtype) for p in model.parameters()} == {("meta", torch.bfloat16)}
    assert model.get_submodule(model.pretrained_cfg["classifier"]) is model.get_classifier()


def test_forward_intermediates_honours_grad_checkpointing(monkeypatch):
    import crate_clip.models.crate_alpha as crate_alpha_module

    calls = []
    real = crate_alpha_module.checkpoint
    monkeypatch.setattr(crate_alpha_module, "checkpoint", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    model = tiny(img_size=32)
    x = torch.randn(2, 3, 32, 32)
    plain = model.forward_intermediates(x, intermediates_only=True)[-1].sum()
    plain.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    model.set_grad_checkpointing(True)
    checked = model.forward_intermediates(x, intermediates_only=True)[-1].sum()
    checked.backward()
    # exact: non-reentrant checkpointing runs the same grad-enabled forward (only the saving differs)
    assert len(calls) == len(model.blocks) and torch.equal(plain, checked)
    for n, g in grads.items():
        torch.testing.assert_close(model.get_parameter(n).grad, g, msg=n)


def test_mssa_scripts_with_torchscript():
    from crate_clip.models.mssa import MSSA

    torch.manual_seed(0)
    attn, y = MSSA(16, 2).eval(), torch.randn(2, 5, 16)
    scripted = torch.jit.script(attn)
    for return_attn in (False, True):
        (out, a), (ref, a_ref) = scripted(y, return_attn), attn(y, return_attn)
        torch.testing.assert_close(out, ref)
        assert (a is None) == (a_ref is None) == (not return_attn)


@pytest.mark.parametrize("name,size", [("crate_alpha_tiny_patch16_224", 32), ("crate_tiny_patch16_224", 32),
                                       ("crate_alpha_clipa.w128_d4_h4_p7_28", 28)])
def test_towers_script_with_torchscript_and_reload(name, size, tmp_path):
    """torch.jit.script of a whole tower (timm's TorchScript tests), saved and loaded back; resampling the position
    embedding per forward (dynamic_img_size) stays eager: a scripted tower runs at its own grid."""
    model = tiny(name, img_size=size).eval()
    torch.jit.save(torch.jit.script(model), tmp_path / "tower.pt")
    scripted = torch.jit.load(tmp_path / "tower.pt")
    x = torch.randn(2, 3, size, size)
    with torch.no_grad():
        # the same ops through TorchScript's interpreter: ISTA's addmm rounds differently in the last bit
        torch.testing.assert_close(scripted(x), model(x), rtol=1e-5, atol=1e-6)
    dynamic = torch.jit.script(tiny(name, img_size=size, dynamic_img_size=True).eval())
    with pytest.raises(Exception, match="ignored"):
        dynamic(torch.randn(1, 3, size + 16, size + 16))


@pytest.mark.slow
def test_compile_fullgraph_and_export_match_eager():
    model = tiny(img_size=32).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        eager = model(x)
        torch.testing.assert_close(torch.compile(model, fullgraph=True, backend="eager")(x), eager)
        torch.testing.assert_close(torch.export.export(model, (x,)).module()(x), eager)


@pytest.mark.slow
def test_the_compiled_block_fuses_its_element_wise_chain_and_matches_eager_forward_and_backward():
    """`model.compile: true` is the fused path of the CRATE-alpha block (issue 55 item 2: inductor fuses ISTA's shrink
    and ReLUs, the residual adds and the LayerNorms; bench/bench_crate_block.py measures it): one block's output and
    every gradient equal eager's to float tolerance, and its generated code holds fused element-wise kernels."""
    from torch._inductor.utils import run_and_get_code

    from crate_clip.models.crate_alpha import CrateBlock

    torch.manual_seed(0)
    block = CrateBlock(16, 2)
    block.init_weights()
    x = torch.randn(3, 5, 16, requires_grad=True)
    g = torch.randn(3, 5, 16)

    def grads(fn):
        for p in [x, *block.parameters()]:
            p.grad = None
        out = fn(x)
        out.backward(g)
        return [out.detach(), x.grad, *[p.grad.clone() for p in block.parameters()]]

    eager = grads(block)
    with torch._inductor.config.patch(compile_threads=1):   # no pool of compile workers: each imports torch
        compiled, code = run_and_get_code(grads, torch.compile(block))
    for got, want in zip(compiled, eager):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)   # fused reductions round differently per CPU
    assert any("cpp_fused" in c for c in code)   # the element-wise chain as generated C++ loops


@pytest.mark.parametrize("name,size", [("crate_alpha_tiny_patch16_224", 32), ("crate_alpha_clipa.w128_d4_h4_p4_28", 28)])
def test_fx_symbolic_trace_matches_eager(name, size):
    """torch.fx traces the tower: the grid and position-embedding checks are leaf calls run with the graph."""
    model = tiny(name, img_size=size, dynamic_img_size=True).eval()
    graph = torch.fx.symbolic_trace(model)
    with torch.no_grad():
        for side in (size, size + 16):   # another size: resampled when the graph runs, not fixed at trace time
            x = torch.randn(2, 3, side, side)
            torch.testing.assert_close(graph(x), model(x), rtol=0, atol=0)   # exact: the graph calls the same ops
    fixed = torch.fx.symbolic_trace(tiny(name, img_size=size).eval())
    with pytest.raises(ValueError, match="call set_input_size"):
        fixed(torch.randn(1, 3, size + 16, size + 16))


def test_timm_fx_feature_extraction_gives_the_block_outputs():
    """timm's fx feature path ("blocks.i" nodes) returns each block's output, as forward_intermediates does."""
    model = tiny(img_size=32).eval()
    nodes = timm.models.get_graph_node_names(model)[1]
    assert "patch_grid" in nodes and "pos_embed_for_grid" in nodes and nodes[-1] == "head"   # leaf calls
    features = tiny(img_size=32, features_only=True, feature_cls="fx", out_indices=(0, 1)).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        ref = model.forward_intermediates(x, output_fmt="NLC", return_prefix_tokens=True, intermediates_only=True)
        for out, (spatial, prefix) in zip(features(x), ref, strict=True):
            torch.testing.assert_close(out, torch.cat([prefix, spatial], 1), rtol=0, atol=0)
