"""Evaluation reliability: the classifier cache key, eval shards split by whole shards, corrupt tars."""
import open_clip
import pytest
import torch

from crate_clip.eval.class_sets import FASHION_MNIST_CLASSNAMES, FASHION_MNIST_TEMPLATES
from crate_clip.eval.classifier_cache import classifier_key
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

    from crate_clip.eval.model_loading import load_eval_model
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


def _cls_tar(path, keys, label=3):
    import io
    import tarfile

    from data_fixtures import jpeg_bytes
    with tarfile.open(path, "w") as tar:
        for key in keys:
            for ext, data in (("jpg", jpeg_bytes()), ("cls", str(label).encode())):
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return path


def test_eval_shards_go_whole_to_ranks_and_a_corrupt_tar_is_counted(tmp_path):
    from crate_clip.eval.eval_datasets import ShardSamples

    urls = [str(_cls_tar(tmp_path / f"{s:08d}.tar", [f"{s}{i:04d}" for i in range(3)])) for s in range(2)]
    broken = tmp_path / "00000002.tar"
    broken.write_bytes(b"not a tar at all\n" * 100)
    urls += [str(broken), str(_cls_tar(tmp_path / "00000003.tar", ["30000"]))]
    transform = lambda img: torch.zeros(1)   # noqa: E731
    per_rank = [list(ShardSamples(urls, transform, "cls", 10, rank=r, world=2)) for r in range(2)]
    assert {s[3].split(":")[0] for s in per_rank[0]} == {urls[0], urls[2]}   # whole shards 0 and 2
    assert {s[3].split(":")[0] for s in per_rank[1]} == {urls[1], urls[3]}
    unreadable = [s[3] for r in per_rank for s in r if s[0] is None]
    assert len(unreadable) == 1 and str(broken) in unreadable[0] and "unreadable tar" in unreadable[0]
    assert sum(s[0] is not None for r in per_rank for s in r) == 3 + 3 + 1


def test_a_truncated_eval_tar_is_counted_with_its_file_named(tmp_path):
    import tarfile

    from crate_clip.eval.eval_datasets import ShardSamples

    whole = _cls_tar(tmp_path / "00000000.tar", [f"{i:05d}" for i in range(4)])
    data = whole.read_bytes()
    cut = tmp_path / "00000001.tar"
    # cut at a member boundary (after two of the four samples' members): tarfile reads it without an error
    members = tarfile.open(whole).getmembers()
    cut.write_bytes(data[:members[4].offset])
    transform = lambda img: torch.zeros(1)   # noqa: E731
    samples = list(ShardSamples([str(whole), str(cut)], transform, "cls", 10))
    unreadable = [s[3] for s in samples if s[0] is None]
    assert len(unreadable) == 1 and str(cut) in unreadable[0] and "truncated tar" in unreadable[0]
    assert sum(s[0] is not None for s in samples) == 4 + 2
