"""The export's model card publishes what a reader can act on: the project's licence, how to install crate-clip
(which no registry serves) from its source or a wheel, every measured result (the demo's linear probe too), and
no local path of the machine the run was on."""
from pathlib import Path

import yaml

from crate_clip.checkpoint_io.checkpoint_record import CheckpointInfo
from crate_clip.export.source import ExportSource
from crate_clip.export.model_card import model_card, project_license, public_name
from crate_clip.eval.tasks.linear_probe import summary

REPO_ROOT = Path(__file__).resolve().parents[1]
CONFIG = {"model_cfg": {"vision_cfg": {"image_size": 28, "patch_size": 7, "timm_model_name": "crate_alpha_x"},
                        "text_cfg": {"context_length": 16}},
          "preprocess_cfg": {"resize_mode": "shortest", "interpolation": "bicubic", "mean": [0.5] * 3,
                             "std": [0.25] * 3}}
PROBE = {"top1": 0.8431, "top5": 0.995, "mean_per_class_recall": 0.8431, "features": "image", "feature_dim": 64,
         "weight_decay": 1e-4, "n_train": 10000, "n_test": 10000}


def _source(tmp_path: Path, sources: list[str]) -> ExportSource:
    tag = tmp_path / "runs" / "demo" / "checkpoints" / "stage1-step00000010"
    tag.mkdir(parents=True)
    run = {"run": {"name": "demo", "seed": 0}, "stages": [{"name": "full", "samples": 64, "global_batch": 32}],
           "data": {"sources": sources, "crop_scale": [0.9, 1.0]}}
    info = {"model_name": "CRATE-alpha-CLIPA-tiny", "image_size": 28, "context_length": 16, "stage_index": 0,
            "stage_name": "full", "step": 2, "stage_steps": 2, "run_config": run}
    results = [{"stage_index": 0, "stage_name": "full", "eval": "zeroshot", "image_size": 28, "top1": 0.841,
                "top5": 0.9954, "mean_per_class": 0.841, "n_images": 10000, "n_unreadable": 0}]
    return ExportSource(tag, CheckpointInfo.from_dict(info), None, results)


def test_card_has_the_projects_license_and_a_source_install(tmp_path):
    card = model_card(_source(tmp_path, ["s3://bucket/{0..9}.tar"]), CONFIG)
    front = yaml.safe_load(card.split("---")[1])
    setup_license = next(line.split("=", 1)[1].strip() for line in (REPO_ROOT / "setup.cfg").read_text().splitlines()
                         if line.startswith("license"))
    assert front["license"] == setup_license.lower() == project_license().lower() == "apache-2.0"
    assert "pip install crate-clip" not in card
    assert "`pip install .` in a checkout" in card and "pip wheel --no-deps ." in card


def test_card_publishes_no_local_path(tmp_path):
    inside = tmp_path / "runs" / "demo" / "data" / "train"
    outside = tmp_path / "elsewhere" / "fashion_mnist" / "train"
    source = _source(tmp_path, [str(inside), str(outside), "s3://bucket/{0..9}.tar"])
    card = model_card(source, CONFIG)
    assert str(tmp_path) not in card and "/elsewhere/" not in card
    assert "`data/train`" in card and "`s3://bucket/{0..9}.tar`" in card
    assert f"`{public_name(str(outside))}`" in card and public_name(str(outside)).startswith("train (local path, ")
    assert public_name(str(outside)) != public_name(str(tmp_path / "other" / "train"))   # the hash tells them apart


def test_card_lists_every_measured_result_with_the_linear_probe(tmp_path):
    card = model_card(_source(tmp_path, ["s3://b/x.tar"]), CONFIG, probes=[PROBE])
    results = card.split("## Results")[1].split("## Usage")[0]
    assert "top-1 84.10%" in results
    assert summary(PROBE) in results and "top-1 84.31%" in results


def _named_source(tmp_path: Path) -> ExportSource:
    """A checkpoint whose training shards and eval folder were written by the Fashion-MNIST writers (each records
    its data set in dataset.json), evaluated zero-shot after both stages."""
    from dataclasses import replace

    from crate_clip.core.dataset_records import FASHION_MNIST, write_dataset_record

    train, test = tmp_path / "data" / "train", tmp_path / "data" / "test"
    write_dataset_record(train, replace(FASHION_MNIST, split="train"))
    write_dataset_record(test, replace(FASHION_MNIST, split="test"))
    source = _source(tmp_path, [str(train)])
    source.run_config["eval"] = {"evals": [{"name": "fashion_mnist", "type": "zeroshot", "dataset": "fashion_mnist",
                                            "data": str(test)}]}
    source.results[0]["eval"] = "fashion_mnist"
    source.results.append({**source.results[0], "stage_index": 1, "stage_name": "fine", "top1": 0.8581,
                           "top5": None, "image_size": 27, "resize": "patch"})
    return source


def test_card_front_matter_is_hub_metadata_with_the_runs_results(tmp_path):
    card = model_card(_named_source(tmp_path), CONFIG, probes=[PROBE])
    assert card.startswith("---\n")
    front = yaml.safe_load(card.split("---\n")[1])
    assert front["license"] == "apache-2.0" and front["library_name"] == "open_clip"
    assert {"clip", "crate-alpha"} <= set(front["tags"]) and front["datasets"] == ["zalando-datasets/fashion_mnist"]
    assert front["metrics"] == ["accuracy"]
    (entry,) = front["model-index"]
    zeroshot = [r for r in entry["results"] if r["task"]["type"] == "zero-shot-image-classification"]
    assert [m["value"] for r in zeroshot for m in r["metrics"]] == [84.1, 99.54, 85.81]   # results.jsonl, in %
    assert zeroshot[0]["dataset"] == {"name": "Fashion-MNIST", "type": "zalando-datasets/fashion_mnist",
                                      "split": "test"}
    assert "kernel PI-resized" in zeroshot[1]["metrics"][0]["name"]
    (probe,) = [r for r in entry["results"] if r["task"]["type"] == "image-classification"]
    assert probe["metrics"][0]["value"] == 84.31

    # huggingface_hub's own parser (strict: a malformed model-index raises) reads the same results back
    from huggingface_hub import ModelCard

    parsed = ModelCard(card).data
    assert parsed.license == "apache-2.0" and parsed.library_name == "open_clip"
    assert sorted(r.metric_value for r in parsed.eval_results) == [84.1, 84.31, 85.81, 99.54]
    assert {r.dataset_name for r in parsed.eval_results} == {"Fashion-MNIST"}


def test_card_names_the_data_links_the_repository_and_imports_crate_clip_first(tmp_path):
    card = model_card(_named_source(tmp_path), CONFIG, repo_url="https://example.org/crate-clip")
    data = card.split("## Data")[1].split("## Results")[0]
    assert "- shards: Fashion-MNIST (train split, https://github.com/zalandoresearch/fashion-mnist" in data
    assert "sha256" not in data and "`train" not in data
    assert "`fashion_mnist` (Fashion-MNIST test split) at 27 px" in card
    assert "- code: https://example.org/crate-clip" in card
    assert "--repo-url URL" in model_card(_named_source(tmp_path / "b"), CONFIG)   # none configured: says how
    usage = card.split("## Usage")[1]
    assert usage.index("import crate_clip") < usage.index("import open_clip")


def test_an_eval_set_without_a_record_is_named_by_its_builtin_data_set(tmp_path):
    source = _source(tmp_path, ["s3://b/x.tar"])
    source.run_config["eval"] = {"evals": [{"name": "zeroshot", "dataset": "imagenet1k", "data": str(tmp_path)}]}
    front = yaml.safe_load(model_card(source, CONFIG).split("---\n")[1])
    assert front["model-index"][0]["results"][0]["dataset"] == {"name": "ImageNet-1k", "type": "ILSVRC/imagenet-1k",
                                                                "split": "validation"}
    assert front["datasets"] == ["ILSVRC/imagenet-1k"]


def test_a_malformed_dataset_record_is_not_a_name(tmp_path):
    from crate_clip.core.dataset_records import DATASET_FILE, read_dataset_record

    (tmp_path / DATASET_FILE).write_text('["not", "a record"]')
    assert read_dataset_record(tmp_path) is None and read_dataset_record("pipe:cat x.tar") is None
    (tmp_path / DATASET_FILE).write_text('{"name": "Mine", "extra": 1}')
    assert read_dataset_record(tmp_path / "{0..3}.tar").name == "Mine"   # a pattern: its folder's record
