"""The CRATE-alpha text tower: equations (independent float64 reference), causality, open_clip building, gradients,
grad checkpointing, locking, context-length changes and exports that load with only `import crate_clip`."""
import json
import subprocess
import sys

import open_clip
import pytest
import torch

import crate_clip  # noqa: F401  (registers the configs and the text-tower builder)
from crate_clip.models import (CrateAlphaText, CrateTextCfg, create_clip, register_open_clip_configs,
                               resize_text_pos_embed)
from crate_clip.models.open_clip_text_tower import _MARK
from text_tower_fixtures import TEXT, random_text_weights, reference_text_forward, text_cfg

TINY_TEXT = "CRATE-alpha-CLIPA-tiny-crate-text"


def random_tokens(seed: int = 1, batch: int = 3) -> torch.Tensor:
    """Token ids with the end-of-text (the largest id) at a different position per row and zeros after it."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, TEXT["vocab"] - 1, (batch, TEXT["ctx"]), generator=g)
    for b, end in enumerate(range(2, 2 + batch)):
        tokens[b, end], tokens[b, end + 1:] = TEXT["vocab"] - 1, 0
    return tokens


def reference_tower(causal: bool, pool: str, attn_impl: str = "sdpa") -> CrateAlphaText:
    tower = CrateAlphaText.from_cfg(TEXT["embed"], {**text_cfg(causal, pool), "attn_impl": attn_impl}).double()
    tower.load_state_dict(random_text_weights(prefix=""))
    return tower.eval()


@pytest.fixture(scope="module")
def tiny_text_clip():
    torch.manual_seed(0)
    return create_clip(TINY_TEXT)


@pytest.mark.parametrize("attn_impl", ["sdpa", "math"])
@pytest.mark.parametrize("causal,pool", [(True, "argmax"), (False, "last")])   # CLIP's and CLIPA's settings
def test_forward_matches_independent_float64_reference(causal, pool, attn_impl):
    tokens = random_tokens()
    with torch.no_grad():
        ours = reference_tower(causal, pool, attn_impl)(tokens)
    expected = reference_text_forward(random_text_weights(), tokens, causal, pool)
    assert ours.dtype == torch.float64 and ours.shape == (3, TEXT["embed"])
    assert (ours - expected).abs().max().item() <= 1e-9
    assert expected.abs().max().item() > 0.1   # not a vanishing output


def test_causal_tower_ignores_later_tokens_bidirectional_does_not():
    tokens = random_tokens()
    changed = tokens.clone()
    changed[:, 5:] = (changed[:, 5:] + 7) % TEXT["vocab"]
    for causal, same_prefix in ((True, True), (False, False)):
        tower = reference_tower(causal, "last")
        with torch.no_grad():
            a, b = (tower.forward_intermediates(t, indices=1, normalize_intermediates=True)["text_intermediates"][0]
                    for t in (tokens, changed))
        assert torch.equal(a[:, :5], b[:, :5]) == same_prefix
        assert not torch.equal(a[:, 5:], b[:, 5:])


def test_open_clip_builds_it_and_every_parameter_gets_a_gradient():
    torch.manual_seed(0)
    model, _, preprocess = open_clip.create_model_and_transforms(TINY_TEXT)
    assert type(model).__name__ == "CustomTextCLIP" and isinstance(model.text, CrateAlphaText)
    assert model.text.causal and model.text.pool_type == "argmax" and preprocess.transforms[0].size == 28
    tokens = open_clip.get_tokenizer(TINY_TEXT)(["a photo of a sandal", "a shoe", "a bag"])
    img, txt, scale = model(torch.randn(3, 3, 28, 28), tokens)
    assert img.shape == txt.shape == (3, 128)
    open_clip.ClipLoss()(img, txt, scale).backward()
    no_grad = [n for n, p in model.named_parameters() if p.grad is None or p.grad.abs().sum() == 0]
    assert no_grad == []
    inter = model.forward_intermediates(text=tokens, text_indices=1)   # open_clip's API reaches the tower
    assert [t.shape for t in inter["text_intermediates"]] == [(3, 32, 64)] and inter["text_features"].shape == (3, 128)
    assert {"text.positional_embedding", "text.token_embedding.weight", "text.transformer.resblocks.1.ista.D1",
            "text.ln_final.weight"} <= model.no_weight_decay()
    assert "text.transformer.resblocks.0.attn.qkv.weight" not in model.no_weight_decay()


def test_grad_checkpointing_same_output_and_gradients(tiny_text_clip):
    model = tiny_text_clip
    tokens = open_clip.get_tokenizer(TINY_TEXT)(["a coat", "an ankle boot"])

    def run():
        model.zero_grad()
        out = model.encode_text(tokens)
        out.square().sum().backward()
        return out.detach(), {n: p.grad.clone() for n, p in model.text.named_parameters()}

    def intermediates():
        return model.text.forward_intermediates(tokens, return_sparse_codes=True)

    plain, grads = run()
    plain_inter = intermediates()
    model.set_grad_checkpointing(True)
    try:
        assert model.text.transformer.grad_checkpointing
        checked, grads_ckpt = run()
        checked_inter = intermediates()
    finally:
        model.set_grad_checkpointing(False)
    assert torch.equal(plain, checked)   # the same kernels on the same inputs
    for key, values in plain_inter.items():
        values = values if isinstance(values, list) else [values]
        others = checked_inter[key] if isinstance(checked_inter[key], list) else [checked_inter[key]]
        assert all(torch.equal(a, b) for a, b in zip(values, others, strict=True)), key
    for name, g in grads.items():   # recomputation reorders the accumulation: rounding-level differences only
        torch.testing.assert_close(grads_ckpt[name], g, msg=name)


def test_lock_text_tower_freezes_it_and_leaves_the_last_groups():
    model = create_clip(TINY_TEXT)
    model.lock_text_tower()
    assert not any(p.requires_grad for p in model.text.parameters())
    assert all(p.requires_grad for p in model.visual.parameters()) and model.logit_scale.requires_grad
    model = create_clip(TINY_TEXT)
    model.lock_text_tower(unlocked_layers=2)   # open_clip's groups: ..., last block + ln_final, projection
    trainable = {n for n, p in model.text.named_parameters() if p.requires_grad}
    assert trainable == {"text_projection", "ln_final.weight", "ln_final.bias"} | {
        n for n, _ in model.text.named_parameters() if n.startswith("transformer.resblocks.1.")}
    tokens = open_clip.get_tokenizer(TINY_TEXT)(["a dress"])
    model.encode_text(tokens).sum().backward()
    assert model.text.token_embedding.weight.grad is None and model.text.text_projection.grad is not None


def test_context_length_change_resizes_the_text_position_embedding(tmp_path):
    torch.manual_seed(0)
    short = create_clip(TINY_TEXT, context_length=8)
    assert short.text.positional_embedding.shape == (8, 64)
    torch.save(short.state_dict(), tmp_path / "short.pt")
    full = create_clip(TINY_TEXT, pretrained=str(tmp_path / "short.pt"))   # the config's 32 tokens
    torch.testing.assert_close(full.text.positional_embedding,
                               resize_text_pos_embed(short.text.positional_embedding.detach(), 32))
    assert torch.equal(full.text.transformer.resblocks[0].ista.D, short.text.transformer.resblocks[0].ista.D)


def test_export_loads_in_a_fresh_interpreter_with_only_import_crate_clip(tmp_path, tiny_text_clip):
    from crate_clip.export.writer import export_open_clip

    model = tiny_text_clip.eval()
    export_open_clip(model.state_dict(), TINY_TEXT, tmp_path / "export", image_size=28, context_length=32)
    images = torch.randn(2, 3, 28, 28)
    tokens = open_clip.get_tokenizer(TINY_TEXT)(["a pullover", "a sneaker"])
    torch.save({"images": images, "tokens": tokens}, tmp_path / "inputs.pt")
    script = (
        "import sys, torch, open_clip, crate_clip\n"
        f"model, _, _ = open_clip.create_model_and_transforms('local-dir:{tmp_path / 'export'}')\n"
        f"x = torch.load('{tmp_path / 'inputs.pt'}')\n"
        "model.eval()\n"
        "with torch.no_grad():\n"
        "    out = {'image': model.encode_image(x['images']), 'text': model.encode_text(x['tokens'])}\n"
        f"torch.save(out, '{tmp_path / 'out.pt'}')\n"
        "print(type(model.text).__name__)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "CrateAlphaText"
    out = torch.load(tmp_path / "out.pt")
    with torch.no_grad():
        assert torch.equal(out["image"], model.encode_image(images))
        assert torch.equal(out["text"], model.encode_text(tokens))


def test_bad_configs_are_named(tmp_path):
    with pytest.raises(ValueError, match=r"unknown keys \['widht'\]"):
        CrateTextCfg.from_dict({"tower": "crate_alpha", "widht": 64})
    with pytest.raises(ValueError, match="pool_type must be one of"):
        CrateTextCfg.from_dict({"tower": "crate_alpha", "pool_type": "mean"})
    cfg = open_clip.get_model_config(TINY_TEXT)   # a copy
    del cfg["custom_text"]
    (tmp_path / "no-custom-text.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"no-custom-text\.json.*add \"custom_text\": true"):
        register_open_clip_configs(tmp_path)
    # open_clip's own builder (what runs without `import crate_clip`) rejects the config instead of building another
    open_clip_builder = getattr(open_clip.model._build_text_tower, _MARK)
    with pytest.raises(TypeError, match="tower"):
        open_clip_builder(16, text_cfg(True, "argmax"))
