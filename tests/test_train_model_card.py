"""The export's model card is one a Hub user can upload as it is: the project's licence, how to install crate-clip
(which no registry serves) from its source or a wheel, intended and out-of-scope use, the training data's
limitations, the training procedure, every measured result with its image count (the exported weights' alone in
the model-index, top-5 typed as its own metric), the citations, no message of the tool, and no local path of the
machine the run was on."""
from pathlib import Path

import yaml

from crate_clip.checkpoint_io.checkpoint_record import CheckpointInfo
from crate_clip.export.source import ExportSource
from crate_clip.export.model_card import model_card, project_license, public_name
from crate_clip.eval.tasks.linear_probe import summary

REPO_ROOT = Path(__file__).resolve().parents[1]
CONFIG = {"model_cfg": {"vision_cfg": {"image_size": 28, "patch_size": 7,
                                       "timm_model_name": "crate_alpha_clipa.w128_d4_h4_p7_28"},
                        "text_cfg": {"context_length": 16}},
          "preprocess_cfg": {"resize_mode": "shortest", "interpolation": "bicubic", "mean": [0.5] * 3,
                             "std": [0.25] * 3}}
PROBE = {"top1": 0.8431, "top5": 0.995, "mean_per_class_recall": 0.8431, "features": "image", "feature_dim": 64,
         "weight_decay": 1e-4, "n_train": 10000, "n_test": 10000}


def _source(tmp_path: Path, sources: list[str]) -> ExportSource:
    tag = tmp_path / "runs" / "demo" / "checkpoints" / "stage1-step00000010"
    tag.mkdir(parents=True)
    run = {"run": {"name": "demo", "seed": 0},
           "stages": [{"name": "full", "samples": 64, "global_batch": 32, "image_size": 28}],
           "data": {"sources": sources, "crop_scale": [0.9, 1.0]}, "optimizer": {"betas": [0.9, 0.95]}}
    info = {"model_name": "CRATE-alpha-CLIPA-tiny", "image_size": 28, "context_length": 16, "stage_index": 0,
            "stage_name": "full", "step": 2, "stage_steps": 2, "run_config": run, "world_size": 2,
            "zero_stage": 2, "precision": "fp32", "samples_seen": 64}
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
    results = card.split("## Evaluation")[1].split("## Usage")[0]
    assert "Measured on these weights" in results and "earlier weights" not in results
    assert "top-1 84.10%" in results and "on 10000 images" in results
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
    source.run_config["stages"].append({"name": "fine", "samples": 32, "global_batch": 32, "image_size": 27})
    source.run_config["eval"] = {"evals": [{"name": "fashion_mnist", "type": "zeroshot", "dataset": "fashion_mnist",
                                            "data": str(test)},
                                           {"name": "quick", "dataset": "fashion_mnist", "max_images": 1000}]}
    source.record.progress.stage_index = 1   # the export of stage 1's last checkpoint
    source.results[0]["eval"] = "fashion_mnist"
    source.results.append({**source.results[0], "stage_index": 1, "stage_name": "fine", "top1": 0.8581,
                           "top5": 0.9977, "image_size": 27, "resize": "patch"})
    source.results.append({**source.results[-1], "eval": "quick", "top1": 0.862, "top5": None, "n_images": 1000,
                           "resize": "grid"})
    return source


def test_card_front_matter_is_hub_metadata_with_the_exported_weights_results(tmp_path):
    card = model_card(_named_source(tmp_path), CONFIG, probes=[PROBE])
    assert card.startswith("---\n")
    front = yaml.safe_load(card.split("---\n")[1])
    assert front["license"] == "apache-2.0" and front["library_name"] == "open_clip"
    assert {"clip", "crate-alpha"} <= set(front["tags"]) and front["datasets"] == ["zalando-datasets/fashion_mnist"]
    assert front["metrics"] == ["accuracy"]
    (entry,) = front["model-index"]
    zeroshot = [r for r in entry["results"] if r["task"]["type"] == "zero-shot-image-classification"]
    # stage 1's results alone (the exported weights'): stage 0's 84.10 measured other weights
    assert [(m["type"], m["value"]) for r in zeroshot for m in r["metrics"]] == [
        ("accuracy", 85.81), ("top-5-accuracy", 99.77), ("accuracy", 86.2)]
    assert zeroshot[0]["dataset"] == {"name": "Fashion-MNIST", "type": "zalando-datasets/fashion_mnist",
                                      "split": "test"}
    top1_name = zeroshot[0]["metrics"][0]["name"]
    assert "kernel PI-resized" in top1_name and "10,000 images" in top1_name
    assert zeroshot[1]["dataset"]["name"] == "Fashion-MNIST (1,000-image subset)"   # max_images: 1000
    assert "1,000 images" in zeroshot[1]["metrics"][0]["name"]
    (probe,) = [r for r in entry["results"] if r["task"]["type"] == "image-classification"]
    assert probe["metrics"][0]["value"] == 84.31

    # huggingface_hub's own parsers (strict: a malformed model-index raises) read the same results back
    from huggingface_hub import ModelCard
    from huggingface_hub.repocard_data import model_index_to_eval_results

    parsed = ModelCard(card).data
    assert parsed.license == "apache-2.0" and parsed.library_name == "open_clip"
    name, results = model_index_to_eval_results(front["model-index"])
    assert name == "demo" and [(r.metric_type, r.metric_value) for r in results] == [
        ("accuracy", 85.81), ("top-5-accuracy", 99.77), ("accuracy", 86.2), ("accuracy", 84.31)]
    assert [(r.metric_type, r.metric_value) for r in parsed.eval_results] == [
        (r.metric_type, r.metric_value) for r in results]
    assert {r.dataset_name for r in results} == {"Fashion-MNIST", "Fashion-MNIST (1,000-image subset)"}


def test_card_has_the_hub_templates_sections_and_no_message_of_the_tool(tmp_path):
    card = model_card(_named_source(tmp_path), CONFIG, probes=[PROBE])
    headings = [line for line in card.splitlines() if line.startswith("#")]
    for heading in ("## Uses", "### Intended use", "### Out-of-scope use", "## Bias, risks and limitations",
                    "## Training details", "### Training data", "### Training procedure", "## Evaluation",
                    "## Usage", "## Citation"):
        assert heading in headings, heading
    limits = card.split("## Bias, risks and limitations")[1].split("## Training details")[0]
    assert "Fashion-MNIST: 70,000 grayscale 28 x 28 px photos" in limits and "captions each image" in limits
    procedure = card.split("### Training procedure")[1].split("## Evaluation")[0]
    assert "- 2 stages (28 px -> 27 px), 96 samples in all" in procedure
    assert "- compute: 2 training processes under DeepSpeed ZeRO stage 2, fp32" in procedure
    assert "betas [0.9, 0.95]" in procedure
    results = card.split("## Evaluation")[1].split("## Usage")[0]
    these, earlier = results.split("Measured on earlier weights")
    assert "top-1 85.81%" in these and "(a subset: max_images 1000)" in these and summary(PROBE) in these
    assert "top-1 84.10%" in earlier and "85.81" not in earlier
    citation = card.split("## Citation")[1]
    for entry in ("Scaling White-Box Transformers for Vision", "2405.20299", "An Inverse Scaling Law for {CLIP}",
                  "2305.07017", "{{OpenCLIP}}", "10.5281/zenodo.5143773"):
        assert entry in citation, entry
    assert citation.count("@inproceedings{") == 2 and citation.count("@software{") == 1
    # nothing addressed to the user of the tool: no option to pass, no "not configured"
    assert "--repo-url" not in card and "configured" not in card and "- code:" not in card


def test_card_names_the_data_links_the_repository_and_imports_crate_clip_first(tmp_path):
    card = model_card(_named_source(tmp_path), CONFIG, repo_url="https://example.org/crate-clip")
    data = card.split("### Training data")[1].split("### Training procedure")[0]
    assert "- shards: Fashion-MNIST (train split, https://github.com/zalandoresearch/fashion-mnist" in data
    assert "sha256" not in data and "`train" not in data
    assert "`fashion_mnist` (Fashion-MNIST test split) at 27 px" in card
    assert "- code: https://example.org/crate-clip" in card
    usage = card.split("## Usage")[1].split("## Citation")[0]
    assert usage.index("import crate_clip") < usage.index("import open_clip")
    # the image tower alone in timm, by the export's tower name and weights file (docs/export.md)
    assert ('tower = timm.create_model("crate_alpha_clipa.w128_d4_h4_p7_28", pretrained=True,\n'
            '                          pretrained_cfg_overlay=dict(file=f"{folder}/open_clip_model.safetensors"))'
            ) in usage


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
