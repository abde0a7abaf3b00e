"""The paper's CRATE-alpha-CLIPA: CLIPA text tower configs, released-weight import, BERT tokenizer, pos-embed modes."""
import hashlib
import json
from copy import deepcopy
from pathlib import Path

import numpy as np
import open_clip
import pytest
import torch

import crate_clip  # noqa: F401  (registers the configs)
from crate_clip.models import (CheckpointMismatchError, bert_text_cfg, clip_tokenizer, create_clip, load_clip_weights,
                               load_official_clipa, load_text_tower, register_open_clip_configs, resize_image_pos_embed,
                               text_tower_keys)
from crate_clip.models.official_clipa import official_key
from crate_clip.models.pos_embed import _resize_sequence
from clipa_fixtures import (SMALL, official_image_forward, official_text_forward, random_official_clipa,
                            write_small_configs)

REPO_ROOT = Path(__file__).resolve().parents[1]
BERT_VOCAB = REPO_ROOT.parent / "shared" / "bert_base_uncased"


@pytest.fixture(scope="module")
def small_names(tmp_path_factory):
    folder = tmp_path_factory.mktemp("clipa_configs")
    names = write_small_configs(folder)
    assert sorted(register_open_clip_configs(folder)) == sorted(names)
    return names


@pytest.fixture(scope="module")
def small(small_names):
    return small_names[0]


@pytest.fixture(scope="module")
def official(tmp_path_factory):
    sd = random_official_clipa()
    path = tmp_path_factory.mktemp("official") / "crate_alpha_CLIPA_small.pth"
    torch.save({k: v.float() for k, v in sd.items()}, path)
    return sd, path


@pytest.fixture(scope="module")
def bert_vocab():
    if not (BERT_VOCAB / "vocab.txt").is_file():
        pytest.skip(f"{BERT_VOCAB}/vocab.txt is absent (the BERT vocabulary is provided for tests in ../shared)")
    return BERT_VOCAB


def _meta_clip(name: str):
    with torch.device("meta"):
        return open_clip.model.CLIP(**deepcopy(open_clip.get_model_config(name)))


@pytest.mark.parametrize("name,released,blocks,width", [("CRATE-alpha-CLIPA-L-14", 640_165_889, 24, 1024),
                                                        ("CRATE-alpha-CLIPA-H-14", 967_866_369, 32, 1280)])
def test_counts_match_the_released_files(name, released, blocks, width):
    model = _meta_clip(name)
    total = sum(p.numel() for p in model.parameters())
    text = sum(model.get_parameter(k).numel() for k in text_tower_keys(model, include_logit_scale=False))
    assert text == 336_160_768
    if name.endswith("L-14"):
        assert total == 589_834_241
        # a released L/14 file has 492 keys; 98 of them LayerNorm biases (absent from a torch >= 2.1 save: 394)
        keys = [official_key(k) for k in model.state_dict()]
        assert len(keys) == 492 and sum(k.endswith(".bias") and k.split(".")[-2].startswith("ln_") for k in keys) == 98
    assert released - total == 2 * blocks * width * width   # the two redundant copies of U per image block


@pytest.mark.parametrize("layernorm_bias", [True, False], ids=["torch2.0-layout", "torch2.1-layout-no-ln-bias"])
def test_official_import_equals_float64_reference(small, official, layernorm_bias, tmp_path, caplog):
    """Files of either LayerNorm layout (the port's LayerNorms have biases under torch 2.0, none from 2.1 on)
    compute the independent float64 forward of the official model; the bias-free one is said in one line."""
    sd, path = official
    if not layernorm_bias:
        sd = random_official_clipa(layernorm_bias=False)
        path = _save(tmp_path, sd, "crate_alpha_CLIPA_small_torch21.pth")
        assert len(random_official_clipa()) - len(sd) == 2 * (SMALL["depth"] + SMALL["tdepth"]) + 2
    with caplog.at_level("WARNING"):
        model = load_official_clipa(path, small).double().eval()
    said = [r.getMessage() for r in caplog.records if "without LayerNorm biases" in r.getMessage()]
    assert len(said) == (0 if layernorm_bias else 1)
    if not layernorm_bias:
        assert "10 biases set to zero" in said[0] and not model.state_dict()["visual.trunk.norm.bias"].any()
        text_only = create_clip(small)
        load_text_tower(text_only, path)   # the frozen-text path reads the same file
        assert not text_only.state_dict()["ln_final.bias"].any()
    sd = {k: v.float().double() for k, v in sd.items()}   # what the file holds
    g = torch.Generator().manual_seed(1)
    images = torch.randn(3, 3, SMALL["px"], SMALL["px"], generator=g, dtype=torch.float64)
    tokens = torch.randint(1, SMALL["vocab"], (3, SMALL["ctx"]), generator=g)
    tokens[0, 4:] = 0  # padded: "last" pooling then reads a pad position, as in the released model
    with torch.no_grad():
        img, txt = model.encode_image(images), model.encode_text(tokens)
    ref_img, ref_txt = official_image_forward(sd, images), official_text_forward(sd, tokens)
    assert (img - ref_img).abs().max().item() <= 1e-9 and img.abs().max().item() > 0.1
    assert (txt - ref_txt).abs().max().item() <= 1e-9 and txt.abs().max().item() > 0.1
    # the same file through create_clip(pretrained=...) (layout detected)
    again = create_clip(small, pretrained=str(path)).double().eval()
    with torch.no_grad():
        assert torch.equal(again.encode_text(tokens), txt)


def test_forgetting_the_text_projection_transpose_would_show(official):
    sd, _ = official
    sd = dict(sd)
    tokens = torch.randint(1, SMALL["vocab"], (2, SMALL["ctx"]))
    wrong = dict(sd, text_projection=sd["text_projection"].t())
    assert (official_text_forward(sd, tokens) - official_text_forward(wrong, tokens)).abs().max() > 1e-3


def _save(tmp_path, sd, name="bad.pth"):
    path = tmp_path / name
    torch.save({k: v.float() for k, v in sd.items()}, path)
    return path


def test_import_errors_name_the_keys(tmp_path, small, official):
    sd, _ = official
    bad = dict(sd)
    bad["visual.transformer.resblocks.1.attn.in_proj_bias"] = torch.zeros(96)
    del bad["visual.transformer.resblocks.0.mlp.c_proj"]
    w = bad["visual.transformer.resblocks.1.attn.in_proj_weight"].clone()
    w[70, 3] += 1.0   # V block differs from Q
    bad["visual.transformer.resblocks.1.attn.in_proj_weight"] = w
    with pytest.raises(CheckpointMismatchError, match=r"unexpected keys \[visual\.transformer\.resblocks\.1\.attn\."
                                                      r"in_proj_bias\].*differ.*resblocks\.1\.attn\.in_proj_weight"):
        load_official_clipa(_save(tmp_path, bad), small)
    missing = dict(sd)
    del missing["visual.transformer.resblocks.0.mlp.c_proj"]
    with pytest.raises(CheckpointMismatchError,
                       match=r"missing keys \[visual\.transformer\.resblocks\.0\.mlp\.c_proj\]"):
        load_official_clipa(_save(tmp_path, missing), small)
    shape = dict(sd, **{"token_embedding.weight": torch.zeros(60, SMALL["tw"])})
    with pytest.raises(CheckpointMismatchError, match=r"token_embedding\.weight.*\(60, 16\), \(50, 16\)"):
        load_official_clipa(_save(tmp_path, shape), small)
    some_biases = dict(sd)   # a file missing only some LayerNorm biases is not a layout: they are missing keys
    del some_biases["visual.transformer.resblocks.1.ln_2.bias"]
    with pytest.raises(CheckpointMismatchError, match=r"missing keys \[visual\.transformer\.resblocks\.1\.ln_2\."
                                                      r"bias\]"):
        load_official_clipa(_save(tmp_path, some_biases), small)
    with pytest.raises(CheckpointMismatchError, match="not the official CRATE-alpha-CLIPA layout"):
        load_official_clipa(_save(tmp_path, create_clip(small).state_dict(), "ours.pt"), small)


def test_text_tower_only_from_official_or_open_clip_layout(small, official):
    sd, path = official
    torch.manual_seed(3)
    model = create_clip(small)
    image_before = {k: v.clone() for k, v in model.state_dict().items() if k.startswith("visual.")}
    keys = load_text_tower(model, path)
    assert "logit_scale" in keys and "text_projection" in keys and not any(k.startswith("visual.") for k in keys)
    reference = load_official_clipa(path, small)
    for k in keys:
        assert torch.equal(model.state_dict()[k], reference.state_dict()[k]), k
    for k, v in image_before.items():
        assert torch.equal(model.state_dict()[k], v), k
    other = create_clip(small)
    assert load_text_tower(other, reference.state_dict(), include_logit_scale=False) == \
        [k for k in keys if k != "logit_scale"]
    with pytest.raises(CheckpointMismatchError, match="ln_final.weight"):
        load_text_tower(other, {k: v for k, v in reference.state_dict().items() if k != "ln_final.weight"})


# ---------------------------------------------------------------- position embeddings
def _jax_linear_resize(x: np.ndarray, new_len: int) -> np.ndarray:
    """jax.image.resize(method='linear'/'bilinear', antialias=True) along axis 1, from its published formula
    (scale_and_translate with a triangle kernel; half-pixel centres; widened kernel when shrinking)."""
    old = x.shape[1]
    scale = new_len / old
    kernel_scale = max(1 / scale, 1.0)
    sample = (np.arange(new_len) + 0.5) / scale - 0.5
    dist = np.abs(sample[None, :] - np.arange(old)[:, None]) / kernel_scale
    w = np.maximum(0.0, 1 - dist)
    w = w / w.sum(axis=0, keepdims=True)
    w[:, (sample < -0.5) | (sample > old - 0.5)] = 0
    return np.einsum("bld,ln->bnd", x, w)


@pytest.mark.parametrize("old,new", [((6, 6), (16, 16)), ((16, 16), (6, 6)), ((5, 5), (14, 14))])
def test_official_1d_resize_is_jax_bilinear_over_the_sequence(old, new):
    pos = torch.randn(1, 1 + old[0] * old[1], 8, dtype=torch.float64)
    got = _resize_sequence(pos, 1 + new[0] * new[1])   # the 1-D rule itself, jax's antialias when shrinking
    assert got.shape == (1, 1 + new[0] * new[1], 8)
    np.testing.assert_allclose(got.numpy(), _jax_linear_resize(pos.numpy(), got.shape[1]), rtol=0, atol=1e-6)
    grid = resize_image_pos_embed(pos, new, old, mode="grid_2d")
    assert torch.equal(grid[:, 0], pos[:, 0]) and not torch.allclose(grid, got)  # the two modes differ
    if new[0] > old[0]:   # growing: official_1d is this rule (shrinking: grid_2d, test_eval_resolution_transfer)
        assert torch.equal(resize_image_pos_embed(pos, new, old, mode="official_1d"), got)
    with pytest.raises(ValueError, match="official_1d"):
        resize_image_pos_embed(pos, new, old, mode="bicubic")


@pytest.mark.parametrize("mode", ["official_1d", "grid_2d"])
def test_stage_change_uses_the_run_configs_mode(mode):
    from crate_clip.train.run.run_config import config_from_dict
    from crate_clip.train.stage_setup.stage_model import resolve_stage

    stages = [dict(name=n, image_size=px, context_length=8, samples=4, global_batch=2, lr=1e-3)
              for n, px in (("low", 12), ("full", 28))]
    cfg = config_from_dict({"model": {"name": "CRATE-alpha-CLIPA-tiny", "pos_embed_resize": mode},
                            "data": {"sources": ["x"]}, "stages": stages}, check_paths=False)
    low = resolve_stage(cfg, 0).build_model()
    weights = low.state_dict()
    full = resolve_stage(cfg, 1).build_model(weights)
    expected = resize_image_pos_embed(weights["visual.trunk.pos_embed"], (7, 7), (3, 3), mode=mode)
    assert torch.equal(full.visual.trunk.pos_embed.detach(), expected)


def test_bad_resize_mode_in_run_config_is_named():
    from crate_clip.train.run.run_config import ConfigError, config_from_dict

    with pytest.raises(ConfigError, match=r"model\.pos_embed_resize: 'linear' is not one of"):
        config_from_dict({"model": {"pos_embed_resize": "linear"}, "data": {"sources": ["x"]},
                          "stages": [dict(samples=4, global_batch=2)]}, check_paths=False)


def test_plain_load_state_dict_never_resamples(small):
    torch.manual_seed(0)
    low = create_clip(small, image_size=16)        # 2x2 grid
    saved = low.visual.trunk.pos_embed.detach().clone()
    model = create_clip(small)                      # 4x4 grid
    assert not hasattr(model.visual.trunk, "_loaded_pos_embed")
    model.load_state_dict(low.state_dict())         # loads the checkpoint as saved: the tower now takes 16 px
    trunk = model.visual.trunk
    assert torch.equal(trunk.pos_embed, saved) and trunk.grid_size == (2, 2)
    with pytest.raises(ValueError, match="set_input_size"):
        model.encode_image(torch.randn(1, 3, 32, 32))
    trunk.set_input_size(32)                        # one resample, from the loaded weights
    assert torch.equal(trunk.pos_embed.detach(), resize_image_pos_embed(saved, (4, 4), (2, 2)))
    fresh = create_clip(small)
    with pytest.raises(CheckpointMismatchError, match=r"visual\.trunk\.pos_embed.*pos_embed_resize"):
        load_clip_weights(fresh, low.state_dict())  # our loader resizes only when asked
    load_clip_weights(fresh, low.state_dict(), pos_embed_resize="official_1d")
    assert torch.equal(fresh.visual.trunk.pos_embed.detach(), resize_image_pos_embed(saved, (4, 4), (2, 2),
                                                                                    "official_1d"))


# ---------------------------------------------------------------- BERT tokenizer
def _ids(vocab_dir: Path, pieces):
    index = {tok: i for i, tok in enumerate((vocab_dir / "vocab.txt").read_text(encoding="utf-8").splitlines())}
    return [index[p] for p in pieces]


def test_clipa_tokenisation_with_the_real_vocabulary(tmp_path, bert_vocab, monkeypatch):
    monkeypatch.setenv("CRATE_CLIP_CACHE", str(tmp_path / "cache"))
    tok = clip_tokenizer("CRATE-alpha-CLIPA-L-14", bert_vocab=bert_vocab)
    ids = tok(["A photo of a Cat.", "playing " * 40]).tolist()
    expected = _ids(bert_vocab, ["[CLS]", "a", "photo", "of", "a", "cat", "."])
    assert ids[0] == expected + [0] * (32 - len(expected))            # no [SEP], padded with 0
    long = ids[1]
    assert long[0] == _ids(bert_vocab, ["[CLS]"])[0] and len(long) == 32
    assert set(long[1:31]) == set(_ids(bert_vocab, ["playing"])) and long[31] == 0   # [SEP] stripped to 0
    before = sorted(p.name for p in bert_vocab.iterdir())
    cfg = bert_text_cfg(bert_vocab)
    assert sorted(p.name for p in bert_vocab.iterdir()) == before    # nothing written beside the vocabulary
    assert cfg["vocab_size"] == 30_522 and Path(cfg["hf_tokenizer_name"]).parent.parent == tmp_path / "cache"
    with pytest.raises(ValueError, match="BPE"):
        clip_tokenizer("CRATE-alpha-CLIP-L-14", bert_vocab=bert_vocab)


def test_official_file_through_eval_loader_and_convert_cli(tmp_path, small_names, official, bert_vocab, monkeypatch):
    """`crate-clip eval`'s loader and `crate-clip convert official` accept the released layout; the export
    loads in plain open_clip (tokenizer files included) with identical weights."""
    from crate_clip.convert_cli import main as convert_main
    from crate_clip.eval.model_loading import load_eval_model

    monkeypatch.setenv("CRATE_CLIP_CACHE", str(tmp_path / "cache"))
    _, path = official
    small = small_names[1]   # the small model with CLIPA's tokenizer setting
    model, _, tokenizer, _ = load_eval_model(small, str(path), bert_vocab=str(bert_vocab))
    reference = load_official_clipa(path, small)
    assert all(torch.equal(v, reference.state_dict()[k]) for k, v in model.state_dict().items())
    out = tmp_path / "export"
    assert convert_main(["official", str(path), "--model", small, "--out", str(out),
                         "--bert-vocab", str(bert_vocab)]) == 0
    loaded, _, _ = open_clip.create_model_and_transforms(f"local-dir:{out}")
    assert all(torch.equal(v, reference.state_dict()[k]) for k, v in loaded.state_dict().items())
    exported_tok = open_clip.get_tokenizer(f"local-dir:{out}")
    assert torch.equal(exported_tok(["a photo of a cat"]), tokenizer(["a photo of a cat"]))
    record = json.loads((out / "open_clip_config.json").read_text())["tokenizer"]
    assert record["name"] == "bert-base-uncased" and record["kwargs"] == {"strip_sep_token": True}
    assert record["vocab_sha1"] == hashlib.sha1((bert_vocab / "vocab.txt").read_bytes()).hexdigest()


def test_open_clip_vit_checkpoints_are_not_taken_for_the_official_layout():
    # open_clip's ViT-*-CLIPA share the OpenAI-style visual names; converting them would transpose their text
    # projection by mistake
    from crate_clip.models import is_official_clipa_layout

    assert not is_official_clipa_layout(_meta_clip("ViT-H-14-CLIPA").state_dict())
    assert is_official_clipa_layout(random_official_clipa())
