"""CRATE-alpha CLIP models in open_clip: configs, forward/backward, save/load round trips, loader errors."""
import json
import math

import open_clip
import pytest
import torch
from safetensors.torch import save_file

import crate_clip  # noqa: F401  (registers the open_clip configs)
from crate_clip.checkpoint_io.safe_unpickling import UntrustedCheckpointError
from crate_clip.models import (CheckpointMismatchError, bert_text_cfg, bert_tokenizer, create_clip, load_clip_weights,
                               register_open_clip_configs, resize_clip_state_dict, set_image_token_mask)

TINY = "CRATE-alpha-CLIPA-tiny"
# a /14 tower, small enough to build at 224 px in a test: width 32, depth 1, 2 heads
SMALL14 = "test-CRATE-alpha-CLIPA-w32-p14"


@pytest.fixture(scope="module")
def small14(tmp_path_factory):
    cfg_dir = tmp_path_factory.mktemp("configs")
    cfg = {"embed_dim": 16,
           "vision_cfg": {"image_size": 224, "timm_model_name": "crate_alpha_clipa_w32_d1_h2_p14_224",
                          "timm_pool": "token", "timm_proj": "linear", "timm_proj_bias": False},
           "text_cfg": {"context_length": 32, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1}}
    (cfg_dir / f"{SMALL14}.json").write_text(json.dumps(cfg))
    assert register_open_clip_configs(cfg_dir) == [SMALL14]
    return SMALL14


def embeddings(model, images, tokens):
    model.eval()
    with torch.no_grad():
        return model.encode_image(images), model.encode_text(tokens)


def test_configs_registered_and_tokenizers():
    names = set(open_clip.list_models())
    assert {TINY, "CRATE-alpha-CLIPA-B-16", "CRATE-alpha-CLIPA-L-14", "CRATE-alpha-CLIPA-H-14"} <= names
    # the CLIP-BPE text towers trained from scratch have their configs under CRATE-alpha-CLIP-*
    assert {"CRATE-alpha-CLIP-B-16", "CRATE-alpha-CLIP-L-14", "CRATE-alpha-CLIP-H-14"} <= names
    assert open_clip.get_tokenizer("CRATE-alpha-CLIP-L-14")(["a photo of a cat"]).shape == (1, 32)
    assert open_clip.get_tokenizer("CRATE-alpha-CLIP-B-16")(["a cat"]).shape == (1, 77)
    cfg = open_clip.get_model_config("CRATE-alpha-CLIP-H-14")
    assert cfg["embed_dim"] == 1024 and cfg["text_cfg"] == {"context_length": 32, "vocab_size": 49408,
                                                            "width": 1024, "heads": 16, "layers": 24}
    for size in ("B-16", "L-14", "H-14"):   # the paper's CLIPA text tower
        text = open_clip.get_model_config(f"CRATE-alpha-CLIPA-{size}")["text_cfg"]
        assert text == {"context_length": 32, "vocab_size": 32000, "hf_tokenizer_name": "bert-base-uncased",
                        "tokenizer_kwargs": {"strip_sep_token": True}, "width": 1024, "heads": 16, "layers": 24,
                        "pool_type": "last", "no_causal_mask": True, "proj_bias": False,
                        "act_kwargs": {"approximate": "tanh"}, "norm_kwargs": {"eps": 1e-6}}


def test_tiny_clip_forward_backward():
    model, _, preprocess = open_clip.create_model_and_transforms(TINY)
    tokens = open_clip.get_tokenizer(TINY)(["a shirt", "a shoe", "a bag"])
    assert tokens.shape == (3, 32) and preprocess.transforms[0].size == 28
    img, txt, scale = model(torch.randn(3, 3, 28, 28), tokens)
    assert img.shape == txt.shape == (3, 128)
    torch.testing.assert_close(img.norm(dim=-1), torch.ones(3))
    assert scale.item() == torch.tensor(math.log(1 / 0.07)).exp().item()   # CLIP's init: log(1/0.07), float32
    open_clip.ClipLoss()(img, txt, scale).backward()
    inter = model.forward_intermediates(image=torch.randn(1, 3, 28, 28), image_indices=2)["image_intermediates"]
    assert [t.shape for t in inter] == [(1, 128, 7, 7)] * 2  # open_clip's API reaches the tower's intermediates
    trunk = model.visual.trunk
    assert trunk.patch_embed.proj.bias is None
    for p in (trunk.blocks[0].ista.D1, trunk.blocks[-1].attn.qkv.weight, model.visual.head.proj.weight,
              model.token_embedding.weight, model.logit_scale):
        assert p.grad is not None and p.grad.abs().sum() > 0


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_open_clip_round_trip_identical_embeddings(tmp_path, suffix):
    torch.manual_seed(0)
    model = create_clip(TINY).eval()
    path = tmp_path / f"clip{suffix}"
    if suffix == ".safetensors":
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    else:
        torch.save({"state_dict": {"module." + k: v for k, v in model.state_dict().items()}}, path)
    loaded, _, _ = open_clip.create_model_and_transforms(TINY, pretrained=str(path))
    images, tokens = torch.randn(2, 3, 28, 28), open_clip.get_tokenizer(TINY)(["a coat", "a boot"])
    for a, b in zip(embeddings(model, images, tokens), embeddings(loaded, images, tokens)):
        assert torch.equal(a, b)


def test_84px_checkpoint_into_224px_model(tmp_path, small14):
    torch.manual_seed(0)
    low = create_clip(small14, image_size=84, context_length=8)
    assert low.visual.trunk.pos_embed.shape == (1, 37, 32) and low.positional_embedding.shape == (8, 32)
    path = tmp_path / "stage1.pt"
    torch.save(low.state_dict(), path)
    high = create_clip(small14, pretrained=str(path))  # our loader, at the config's 224 px / 32 tokens
    pos = high.visual.trunk.pos_embed
    assert pos.shape == (1, 257, 32) and torch.equal(pos[:, 0], low.visual.trunk.pos_embed[:, 0])
    expected = resize_clip_state_dict(low.state_dict(), high)
    torch.testing.assert_close(pos, expected["visual.trunk.pos_embed"])
    assert high.positional_embedding.shape == (32, 32)
    torch.testing.assert_close(high.visual.trunk.blocks[0].ista.D, low.visual.trunk.blocks[0].ista.D)
    assert high.encode_image(torch.randn(1, 3, 224, 224)).shape == (1, 16)
    # through open_clip at the checkpoint's own size: exactly the saved model
    same, _, pre = open_clip.create_model_and_transforms(small14, pretrained=str(path), force_image_size=84,
                                                         force_context_length=8)
    assert pre.transforms[0].size == 84
    images, tokens = torch.randn(2, 3, 84, 84), open_clip.get_tokenizer(small14, context_length=8)(["a", "b c"])
    for a, b in zip(embeddings(low, images, tokens), embeddings(same, images, tokens)):
        assert torch.equal(a, b)


def test_mismatched_keys_are_named(tmp_path):
    model = create_clip(TINY)
    sd = model.state_dict()
    sd["visual.trunk.blocks.0.ista.E"] = sd.pop("visual.trunk.blocks.0.ista.D1")
    with pytest.raises(CheckpointMismatchError, match=r"missing keys \[visual\.trunk\.blocks\.0\.ista\.D1\]"
                                                      r".*unexpected keys \[visual\.trunk\.blocks\.0\.ista\.E\]"):
        load_clip_weights(model, sd)
    wrong = create_clip(TINY).state_dict()
    wrong["text_projection"] = torch.zeros(128, 64)
    with pytest.raises(CheckpointMismatchError, match="text_projection"):
        load_clip_weights(model, wrong)
    with pytest.raises(FileNotFoundError, match="nope.pt"):
        load_clip_weights(model, tmp_path / "nope.pt")


def test_weights_only_loading(tmp_path):
    model = create_clip(TINY)
    sd = dict(model.state_dict())
    sd["evil"] = torch.nn.Linear(2, 2)  # an object that needs code to unpickle
    torch.save(sd, tmp_path / "pickled.pt")
    with pytest.raises(UntrustedCheckpointError, match=r"pickled.pt: refused: it pickles torch.nn.modules.linear"):
        load_clip_weights(model, tmp_path / "pickled.pt")


def test_logit_scale_shape_and_deepspeed_layout(tmp_path):
    model = create_clip(TINY)
    sd = model.state_dict()
    sd["logit_scale"] = torch.full([1], 2.5)  # DeepSpeed saves it as [1], under "module"
    torch.save({"module": sd, "global_steps": 3}, tmp_path / "mp_rank_00_model_states.pt")
    load_clip_weights(model, tmp_path / "mp_rank_00_model_states.pt")
    assert model.logit_scale.shape == () and model.logit_scale.item() == 2.5


def test_set_image_token_mask_on_clip():
    model = create_clip(TINY).train()
    set_image_token_mask(model, "grid")
    assert model.visual.trunk.forward_features(torch.randn(2, 3, 28, 28)).shape == (2, 1 + 16, 128)
    model.eval()
    assert model.visual.trunk.forward_features(torch.randn(2, 3, 28, 28)).shape == (2, 50, 128)
    with pytest.raises(TypeError, match="CRATE-alpha image tower"):
        set_image_token_mask(torch.nn.Linear(2, 2), "grid")


def test_bert_tokenizer_from_local_vocab(tmp_path):
    words = ["a", "photo", "of", "cat", "dog", "##s"]
    (tmp_path / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + words) + "\n")
    text_cfg = bert_text_cfg(tmp_path)
    assert text_cfg["vocab_size"] == 11
    model = create_clip(TINY, context_length=8, text_cfg=text_cfg)
    tok = bert_tokenizer(tmp_path, context_length=8)
    tokens = tok(["A photo of cats", "dog"])
    assert tokens.tolist()[0][:6] == [2, 5, 6, 7, 8, 10] and tokens.shape == (2, 8)
    feats = model.encode_text(tokens)
    assert feats.shape == (2, 128) and model.token_embedding.num_embeddings == 11
