"""`crate-clip eval zeroshot|retrieval` and the per-stage hook the trainer calls."""
import json
import re

import open_clip
import pytest
import yaml

from crate_clip.cli import main as crate_clip_main
from crate_clip.eval.stage_hook import evaluate_stage
from eval_fixtures import CRATE_TINY, PER_CLASS, shared_crate_tiny


def test_cli_zeroshot_writes_json_and_uses_the_cache(sets, vit_file, tmp_path, capsys):
    name, weights = vit_file
    args = ["eval", "zeroshot", "--model", name, "--pretrained", str(weights), "--data", str(sets["folder"]),
            "--dataset", "fashion_mnist", "--batch-size", "64", "--num-workers", "0",
            "--cache-dir", str(tmp_path / "cache"), "--output", str(tmp_path / "zs.json")]
    assert crate_clip_main(args + ["--per-class", "--per-image-out", str(tmp_path / "per_image.csv")]) == 0
    first = json.loads((tmp_path / "zs.json").read_text())
    header, *rows = (tmp_path / "per_image.csv").read_text().splitlines()
    rows = [tuple(map(int, r.split(","))) for r in rows]   # index, label, top-1 class; every image, in order
    assert header == "index,label,top1" and [r[0] for r in rows] == list(range(first["n_images"]))
    assert sum(label == top1 for _, label, top1 in rows) == round(first["top1"] * first["n_images"])
    assert sorted({r[1] for r in rows}) == list(range(10)) and "per_image" not in first
    out, err = capsys.readouterr()
    assert "zero-shot: top-1" in out and re.search(rf"\nankle boot +{PER_CLASS} +\d", out)
    # stderr is no terminal here: each step's plain line with its total (docs/cli.md#progress), no bar fragments
    assert re.fullmatch(r"\[progress\] text classifier: done, 1/1 batch in \d+\.\d s\n"
                        r"\[progress\] zero-shot images: done, 3/3 batches in \d+\.\d s\n", err), err
    assert crate_clip_main(args + ["--json"]) == 0   # the metrics on stdout as JSON, instead of the summary
    second = json.loads((tmp_path / "zs.json").read_text())
    assert json.loads(capsys.readouterr().out) == {**second, "task": "zeroshot"}
    assert first["n_images"] == 10 * PER_CLASS and first["top1"] > 0.25
    assert (first["cache_hit"], second["cache_hit"]) == (False, True) and second["top1"] == first["top1"]


def test_cli_reads_the_clip_benchmark_wds_layout_of_eval_shards(vit_file, fashion_mnist_dir, tmp_path):
    """`crate-clip shards eval-shards` writes CLIP_benchmark's wds/ layout; `crate-clip eval` reads its root or its
    split folder, with the data set's own classnames.txt and {c} templates (as CLIP_benchmark reads them)."""
    from crate_clip.data.cli import main as shards_main

    name, weights = vit_file
    out = tmp_path / "fmnist_wds"
    assert shards_main(["eval-shards", "--out", str(out), "--max-images", "60", "--samples-per-shard", "25",
                        "--source-dir", str(fashion_mnist_dir)]) == 0
    base = ["eval", "zeroshot", "--model", name, "--pretrained", str(weights), "--dataset", "fmnist_wds",
            "--num-workers", "0", "--no-progress", "--cache-dir", ""]
    results = []
    for data, templates in ((out, []), (out / "test", []), (out, ["--templates", "fashion_mnist"])):
        assert crate_clip_main(base + ["--data", str(data), "--output", str(tmp_path / "r.json")] + templates) == 0
        results.append(json.loads((tmp_path / "r.json").read_text()))
    assert results[0]["n_images"] == 60 and results[0]["top1"] > 0.25
    for key in ("top1", "top5", "mean_per_class", "per_class"):   # the {c} file holds the built-in prompts
        assert results[0][key] == results[1][key] == results[2][key], key


def test_cli_imagenet_on_a_10_class_folder_exits_with_the_reason(sets, vit_file, capsys):
    name, weights = vit_file
    code = crate_clip_main(["eval", "zeroshot", "--model", name, "--pretrained", str(weights),
                            "--data", str(sets["folder"]), "--dataset", "imagenet1k", "--no-progress"])
    assert code == 2
    assert "dataset 'imagenet1k' (1000 classes" in capsys.readouterr().err   # the folder has classnames.txt


def test_cli_retrieval(sets, vit_file, tmp_path):
    name, weights = vit_file
    assert crate_clip_main(["eval", "retrieval", "--model", name, "--pretrained", str(weights),
                            "--data", str(sets["captions"]), "--num-workers", "0", "--no-progress",
                            "--output", str(tmp_path / "rt.json")]) == 0
    result = json.loads((tmp_path / "rt.json").read_text())
    assert result["n_pairs"] == 10 * PER_CLASS and 0 <= result["image_to_text_R@1"] <= result["image_to_text_R@10"]


def test_stage_hook_runs_declared_evals_with_a_deterministic_tokenizer(sets):
    model = shared_crate_tiny()
    evals = [{"name": "fmnist", "type": "zeroshot", "dataset": "fashion_mnist", "data": str(sets["shards"]),
              "templates": "fashion_mnist", "batch_size": 40, "max_images": 60},
             {"name": "captions", "type": "retrieval", "data": str(sets["captions"]), "batch_size": 40}]
    results = evaluate_stage(model, model_name=CRATE_TINY, evals=evals, image_size=28, progress=False)
    assert results["fmnist"]["n_images"] == 60 and results["captions"]["n_pairs"] == 10 * PER_CLASS
    assert model.training is False
    with pytest.raises(ValueError, match=r"unknown keys \['batchsize'\]"):
        evaluate_stage(model, model_name=CRATE_TINY, evals=[{**evals[0], "batchsize": 4}], image_size=28)


def test_eval_tokenizer_drops_a_training_reduction_mask(tmp_path):
    from crate_clip.eval.model_loading import eval_tokenizer
    config = open_clip.get_model_config(CRATE_TINY)
    config["text_cfg"]["tokenizer_kwargs"] = {"reduction_mask": "random"}
    (tmp_path / "evaltest-masked-tiny.json").write_text(json.dumps(config))
    open_clip.add_model_config(tmp_path / "evaltest-masked-tiny.json")
    text = ["a photo of a small red dress with long sleeves, a collar, buttons, pockets and a belt " * 2] * 8
    assert not (open_clip.get_tokenizer("evaltest-masked-tiny")(text) == open_clip.get_tokenizer(CRATE_TINY)(text)).all()
    tokens = eval_tokenizer("evaltest-masked-tiny", shared_crate_tiny())(text)
    assert tokens.shape == (8, open_clip.get_model_config(CRATE_TINY)["text_cfg"]["context_length"]) and (tokens == open_clip.get_tokenizer(CRATE_TINY)(text)).all()


def test_retrieval_eval_in_a_run_config_is_evaluated_and_logged(sets, tmp_path, capsys):
    """A `type: retrieval` eval of a run config goes through the trainer's eval hook and the logger
    (which once read 'top1' from every result); its numbers reach results.jsonl and TensorBoard."""
    from crate_clip.train.stage_setup.engine import DistInfo
    from crate_clip.train.reporting.metrics_log import RESULTS_FILE, MetricsLog, read_jsonl, write_plot
    from crate_clip.train.run.run_config import load_run_config
    from crate_clip.train.checkpointing.checkpoints import Progress
    from crate_clip.train.loop.stage_evals import evaluate_after_stage
    from crate_clip.train.stage_setup.stage_model import resolve_stage

    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({
        "run": {"output_dir": str(tmp_path / "run")}, "model": {"name": CRATE_TINY},
        "data": {"sources": [str(sets["captions"])]}, "precision": "fp32",
        "stages": [{"name": "only", "image_size": 28, "context_length": 16, "samples": 8, "global_batch": 4}],
        "eval": {"evals": [{"name": "captions", "type": "retrieval", "data": str(sets["captions"]),
                            "batch_size": 40}]}}))
    cfg = load_run_config(path)
    cfg.run_dir.mkdir()
    log = MetricsLog(cfg.run_dir, enabled=True, progress=False, tensorboard=True)
    weights = shared_crate_tiny().state_dict()
    records = evaluate_after_stage(cfg, resolve_stage(cfg, 0), weights, Progress(samples_seen=8), log,
                                   DistInfo(0, 1, 0, "cpu"))
    log.close()
    (row,) = read_jsonl(cfg.run_dir / RESULTS_FILE)
    assert records == [row] and row["eval"] == "captions" and row["n_pairs"] == 10 * PER_CLASS
    assert 0 <= row["image_to_text_R@1"] <= row["image_to_text_R@5"] <= row["image_to_text_R@10"] <= 1
    assert "captions at 28 px: retrieval: image_to_text_R@1" in capsys.readouterr().out
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(cfg.run_dir / "tensorboard")).Reload()
    assert "eval/captions@28px/text_to_image_R@10" in events.Tags()["scalars"]
    write_plot(cfg.run_dir)   # no classification result to mark: the loss curve only


def test_eval_settings_are_one_definition_for_run_config_and_cli(sets):
    """Run-config evals can set num_workers, classnames and labels, and get the CLI's defaults."""
    from crate_clip.train.run.run_config import config_from_dict
    from crate_clip.eval.cli import _settings, build_parser

    raw = {"data": {"sources": ["/x"]}, "stages": [{"samples": 8, "global_batch": 4}],
           "eval": {"evals": [{"name": "zeroshot", "data": str(sets["folder"])}]}}
    declared = config_from_dict(raw, check_paths=False).eval.evals[0]
    cli = _settings(build_parser().parse_args(["zeroshot", "--model", "m", "--data", str(sets["folder"])]))
    assert declared == cli and declared.templates is None and declared.dataset is None
    raw["eval"]["evals"][0].update(num_workers=2, classnames="names.txt", labels="labels.txt")
    declared = config_from_dict(raw, check_paths=False).eval.evals[0]
    assert (declared.num_workers, declared.classnames, declared.labels) == (2, "names.txt", "labels.txt")
