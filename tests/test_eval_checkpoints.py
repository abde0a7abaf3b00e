"""Distributed evaluation (2 ranks over gloo, incl. ZeRO-3) and DeepSpeed checkpoints of ZeRO stages 0/2/3."""
import json

import open_clip
import pytest
import torch
from safetensors.torch import save_file

from crate_clip.models.clip_factory import CheckpointMismatchError
from crate_clip.eval.class_sets import FASHION_MNIST_CLASSNAMES, FASHION_MNIST_TEMPLATES
from crate_clip.eval.eval_datasets import classification_dataset
from crate_clip.eval.model_loading import consolidate_deepspeed_checkpoint, eval_transform, load_eval_model
from crate_clip.eval.tasks.zeroshot import zero_shot_evaluate
from eval_fixtures import (CRATE_TINY, DIST_BATCH, DIST_MAX_IMAGES, DS_STAGES, assert_accuracies_agree,
                           shared_crate_tiny)
from train_fixtures import ranks_cmd, run_job

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]
KEYS = ("top1", "top5", "mean_per_class", "n_images", "per_class")


def evaluate(model, tokenizer, shards, max_images=DIST_MAX_IMAGES):
    """One-process zero-shot numbers on the same images the distributed workers see."""
    dataset = classification_dataset(shards, eval_transform(model), dataset="fashion_mnist", num_classes=10)
    return zero_shot_evaluate(model, tokenizer, dataset, FASHION_MNIST_CLASSNAMES, FASHION_MNIST_TEMPLATES,
                              batch_size=DIST_BATCH, max_images=max_images, progress=False)


@pytest.fixture(scope="module")
def distributed_run(tmp_path_factory, sets):
    """Two gloo ranks: plain-model evaluation, then DeepSpeed ZeRO 0/2/3 engines evaluated and checkpointed."""
    workdir = tmp_path_factory.mktemp("distributed")
    (workdir / "shards").symlink_to(sets["shards"], target_is_directory=True)
    torch.save(shared_crate_tiny().state_dict(), workdir / "init.pt")
    # 2 ranks forked from a warm interpreter (fork_ranks.py), not 2 fresh ones (mp.spawn): ~12 s less CPU
    proc = run_job(ranks_cmd(2, "evaluate", str(workdir)), timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return workdir, json.loads((workdir / "results.json").read_text())


def pick(result):
    return {k: result[k] for k in KEYS}


@pytest.mark.timeout(600)
def test_two_ranks_give_the_one_process_numbers(distributed_run):
    workdir, results = distributed_run
    single = evaluate(shared_crate_tiny(), open_clip.get_tokenizer(CRATE_TINY), workdir / "shards")
    assert results["plain"]["world_size"] == 2 and results["plain"]["n_images"] == DIST_MAX_IMAGES
    assert_accuracies_agree(results["plain"], single)   # each rank forwards other batches than one process


@pytest.mark.timeout(600)
@pytest.mark.parametrize("stage", DS_STAGES)
def test_deepspeed_checkpoint_evaluates_like_the_in_memory_engine(distributed_run, stage):
    workdir, results = distributed_run
    model, _, tokenizer, name = load_eval_model(str(workdir / f"ckpt{stage}"))   # via `latest`
    assert name == CRATE_TINY and model.logit_scale.shape == torch.Size([])
    from_disk = evaluate(model, tokenizer, workdir / "shards")
    assert_accuracies_agree(from_disk, results[f"engine{stage}"])   # 1 process vs 2 ranks of the engine: other batches
    # one training step happened: the checkpoint is not the initial model
    init = shared_crate_tiny().state_dict()
    assert not torch.equal(model.state_dict()["visual.trunk.pos_embed"], init["visual.trunk.pos_embed"])


@pytest.mark.timeout(600)
def test_zero_stages_consolidate_to_the_same_weights(distributed_run):
    workdir, _ = distributed_run
    states = {s: consolidate_deepspeed_checkpoint(workdir / f"ckpt{s}" / "stage0_step1")[0] for s in DS_STAGES}
    infos = {s: consolidate_deepspeed_checkpoint(workdir / f"ckpt{s}")[1] for s in DS_STAGES}
    assert [infos[s].zero_stage for s in DS_STAGES] == list(DS_STAGES)
    assert set(states[0]) == set(states[2]) == set(states[3])
    # Same initial weights and one identical AdamW step (lr 1e-3): the stages differ only by reduction order,
    # which can flip the sign of a near-zero update, i.e. by at most about 2 x lr.
    for key, value in states[0].items():
        assert value.dtype == torch.float32 or not value.is_floating_point()
        torch.testing.assert_close(states[3][key].reshape(value.shape), value, atol=2.5e-3, rtol=0)
        torch.testing.assert_close(states[2][key].reshape(value.shape), value, atol=2.5e-3, rtol=0)


@pytest.mark.timeout(600)
def test_create_clip_takes_a_checkpoint_folder_as_pretrained(distributed_run):
    """create_clip(name, pretrained=<checkpoint folder>) holds the consolidated weights (test_models_create_clip.py
    tests its other options)."""
    from crate_clip.models import create_clip
    workdir, _ = distributed_run
    expected = consolidate_deepspeed_checkpoint(workdir / "ckpt3")[0]
    for folder in (workdir / "ckpt3", workdir / "ckpt3" / "stage0_step1"):   # via `latest`, one tag
        got = create_clip(CRATE_TINY, pretrained=folder).state_dict()
        assert set(got) == set(expected)
        for key, value in expected.items():
            torch.testing.assert_close(got[key], value.reshape(got[key].shape), atol=0, rtol=0)


@pytest.mark.timeout(600)
def test_zero3_engine_uses_the_classifier_cache(distributed_run):
    _, results = distributed_run
    assert not results["engine3"]["cache_hit"] and results["engine3_cached"]["cache_hit"]
    assert pick(results["engine3_cached"]) == pick(results["engine3"])   # exact: the same forward, classifier from disk


@pytest.mark.timeout(600)
def test_checkpoint_for_another_model_names_the_keys(distributed_run, tmp_path):
    workdir, _ = distributed_run
    config = tmp_path / "evaltest-other-vit.json"
    config.write_text(json.dumps({"embed_dim": 128, "vision_cfg": {"image_size": 28, "layers": 1, "width": 64,
                                                                   "patch_size": 7},
                                  "text_cfg": {"context_length": 32, "vocab_size": 49408, "width": 128,
                                               "heads": 4, "layers": 4}}))
    open_clip.add_model_config(config)
    with pytest.raises(CheckpointMismatchError, match=r"missing keys \[.+\]; unexpected keys \[.*visual\.trunk\.blocks\.0\."):
        load_eval_model("evaltest-other-vit", pretrained=str(workdir / "ckpt2"))


def test_weights_file_and_local_dir_load_the_same_model(sets, tmp_path):
    reference = shared_crate_tiny()
    state = {k: v.contiguous() for k, v in reference.state_dict().items()}
    save_file(state, tmp_path / "open_clip_model.safetensors")
    (tmp_path / "open_clip_config.json").write_text(json.dumps({
        "model_cfg": open_clip.get_model_config(CRATE_TINY),
        "preprocess_cfg": reference.visual.preprocess_cfg}))
    expected = evaluate(reference, open_clip.get_tokenizer(CRATE_TINY), sets["shards"], max_images=50)
    for model_arg, pretrained in ((CRATE_TINY, str(tmp_path / "open_clip_model.safetensors")),
                                  (f"local-dir:{tmp_path}", None)):
        model, _, tokenizer, _ = load_eval_model(model_arg, pretrained)
        assert pick(evaluate(model, tokenizer, sets["shards"], max_images=50)) == pick(expected)   # exact: a round trip
    with pytest.raises(ValueError, match="is a weights file"):
        load_eval_model(str(tmp_path / "open_clip_model.safetensors"))
