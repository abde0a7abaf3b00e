"""Evaluation reliability (issue 10): the classifier cache key, eval shards split by whole shards, corrupt tars."""
import open_clip
import pytest
import torch

from eval.class_sets import FASHION_MNIST_CLASSNAMES, FASHION_MNIST_TEMPLATES
from eval.classifier_cache import classifier_key
from eval_fixtures import register_tiny_vit

NAMES, TEMPLATES = list(FASHION_MNIST_CLASSNAMES), list(FASHION_MNIST_TEMPLATES)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    name = register_tiny_vit(tmp_path_factory.mktemp("cfg"))
    torch.manual_seed(0)
    return open_clip.create_model(name).eval(), name


def test_cache_key_ignores_logit_scale_and_the_image_tower(tiny):
    model, name = tiny
    tok = open_clip.get_tokenizer(name)
    key = classifier_key(model, tok, NAMES, TEMPLATES, "fp32")
    other = open_clip.create_model(name).eval()
    other.load_state_dict(model.state_dict())
    with torch.no_grad():
        other.logit_scale.add_(1.0)
        other.visual.proj.mul_(2.0)
    assert classifier_key(other, tok, NAMES, TEMPLATES, "fp32") == key
    with torch.no_grad():
        other.token_embedding.weight[0, 0] += 1.0
    assert classifier_key(other, tok, NAMES, TEMPLATES, "fp32") != key


def test_cache_key_tells_tokenizers_of_one_class_apart(tiny):
    from open_clip.tokenizer import SimpleTokenizer

    model, _ = tiny
    lower, plain = SimpleTokenizer(context_length=16), SimpleTokenizer(context_length=16, clean="whitespace")
    assert lower(["T-shirt"]).tolist() != plain(["T-shirt"]).tolist()   # they do tokenize differently
    assert classifier_key(model, lower, NAMES, TEMPLATES, "fp32") != classifier_key(model, plain, NAMES, TEMPLATES,
                                                                                    "fp32")
    assert classifier_key(model, lower, NAMES, TEMPLATES, "fp32") == classifier_key(
        model, SimpleTokenizer(context_length=16), NAMES, TEMPLATES, "fp32")
    assert classifier_key(model, lower, NAMES, TEMPLATES, "fp32") != classifier_key(model, lower, NAMES, TEMPLATES,
                                                                                    "bf16")


def test_evaluating_a_checkpoint_does_not_warn_of_random_weights(tmp_path, caplog):
    import json

    from eval.model_loading import load_eval_model
    from eval_fixtures import CRATE_TINY, shared_crate_tiny

    tag = tmp_path / "checkpoints" / "stage0_step1"
    tag.mkdir(parents=True)
    (tag / "crate_clip.json").write_text(json.dumps({"model_name": CRATE_TINY}))
    torch.save({"module": shared_crate_tiny().state_dict()}, tag / "mp_rank_00_model_states.pt")
    caplog.clear()   # building the reference model above warns, rightly
    with caplog.at_level("WARNING"):
        model = load_eval_model(str(tag))[0]
    assert torch.equal(model.state_dict()["visual.trunk.pos_embed"],
                       shared_crate_tiny().state_dict()["visual.trunk.pos_embed"])
    assert "initialized randomly" not in caplog.text
