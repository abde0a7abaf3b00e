"""The README's first command: Fashion-MNIST shards -> two-stage CLIPA-style training of the tiny CRATE-alpha
CLIP with two CPU processes under ZeRO stage 0 -> zero-shot accuracy after each stage, plot and export.

    python -m crate_clip.train.demo [--nproc 2] [--set stages.0.samples=...] [--resume]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from crate_clip.core.cli_conventions import CommandParser, accept_old_name, add_json_flag, chatter_to_stderr
from crate_clip.core.cli_numbers import NON_NEGATIVE_INT, POSITIVE_INT
from crate_clip.core.errors import EXIT_USAGE
from crate_clip.checkpoint_io.run_layout import (DEMO_PROBE_FILE, PLOT_FILE, checkpoints_dir, eval_cache_dir,
                                                 export_dir)
from crate_clip.data.sources.debian_packages import DEBIAN_PACKAGES

REPO_ROOT = Path(__file__).resolve().parents[2]
# configs/ as installed from a wheel (setup.cfg: crate_clip.configs), else the checkout's
CONFIGS_DIR = next((d for d in (Path(__file__).resolve().parents[1] / "configs", REPO_ROOT / "configs")
                    if d.is_dir()), REPO_ROOT / "configs")
DEMO_CONFIG = CONFIGS_DIR / "demo" / "fashion_mnist.yaml"
DEB_PACKAGE = DEBIAN_PACKAGES["fashion_mnist"]
RECIPE_RESULTS = REPO_ROOT / "docs" / "demo_recipe.json"   # written by bench/bench_demo_recipe.py


def build_parser() -> argparse.ArgumentParser:
    """The demo's arguments (all optional)."""
    p = CommandParser(prog="crate-clip demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(DEMO_CONFIG), help="run config (default: configs/demo/fashion_mnist.yaml)")
    p.add_argument("--data-dir", help="write the shards to DIR/train and the eval set to DIR/test (default: the "
                                      "config's data.sources[0] and eval.evals[0].data)")
    p.add_argument("--run-dir", help="the run's output folder (default: the config's run.output_dir)")
    p.add_argument("--nproc", type=POSITIVE_INT, default=2, help="training processes (default 2)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="run-config override passed to `crate-clip train` (repeatable)")
    p.add_argument("--resume", action="store_true", help="continue the previous demo run instead of starting over")
    p.add_argument("--allow-change", dest="allow_changes", action="append", default=[], metavar="KEY",
                   help="with --resume: passed to the trainer, a change to what the run trains that --set makes "
                        "deliberately (e.g. stages.1.lr; repeatable)")
    p.add_argument("--trust-checkpoint", action="store_true",
                   help="passed to the trainer: resume a demo run of an earlier version (docs/safety.md)")
    p.add_argument("--max-train-images", type=POSITIVE_INT, help="write only the first N training images (a smoke run)")
    p.add_argument("--max-test-images", type=POSITIVE_INT, help="write only the first N test images (a smoke run)")
    accept_old_name(p, "--train-images", "--max-train-images")   # one name across commands: --max-images
    accept_old_name(p, "--test-images", "--max-test-images")
    p.add_argument("--probe-train-images", type=NON_NEGATIVE_INT, default=10_000,
                   help="training images of the final linear probe (the first N of the train split; 0 skips it)")
    add_json_flag(p, "the results (each evaluation, the probe, the training FLOPs, the claims, the export)")
    return p


def ensure_fashion_mnist() -> Path:
    """The Fashion-MNIST idx folder; installs the Debian package when missing and possible."""
    from crate_clip.data.sources.fashion_mnist import find_fashion_mnist

    try:
        return find_fashion_mnist()
    except FileNotFoundError:
        pass
    if shutil.which("apt-get") and os.geteuid() == 0:
        print(f"[demo] installing the Debian package {DEB_PACKAGE} ...", flush=True)
        cmd = ["apt-get", "install", "-y", "-qq", DEB_PACKAGE]
        if subprocess.run(cmd).returncode != 0:
            subprocess.run(["apt-get", "update", "-qq"])
            subprocess.run(cmd)
        return find_fashion_mnist()
    raise FileNotFoundError(
        f"Fashion-MNIST is not installed. Install it with `sudo apt-get install {DEB_PACKAGE}` (Debian/Ubuntu), "
        "or put the four *-ubyte.gz files from the Fashion-MNIST release into ~/.cache/fashion-mnist/")


def prepare_data(train_dir: Path, test_dir: Path, train_images: int | None = None,
                 test_images: int | None = None) -> None:
    """Training shards (train split, 60,000 captioned images) and the zero-shot set (test split, 10,000),
    or the first `train_images` / `test_images` of them."""
    from crate_clip.data.sources.fashion_mnist import write_fashion_mnist_eval_folder, write_fashion_mnist_shards

    source = ensure_fashion_mnist()
    t0 = time.perf_counter()
    write_fashion_mnist_shards(train_dir, split="train", samples_per_shard=5_000, source_dir=source,
                               limit=train_images)
    if not (test_dir / "classnames.txt").is_file():
        write_fashion_mnist_eval_folder(test_dir, split="test", source_dir=source, limit=test_images)
    print(f"[demo] data ready in {time.perf_counter() - t0:.0f} s: shards {train_dir}, eval set {test_dir}", flush=True)


def demo_paths(config: str, data_dir: str | None, run_dir: str | None,
               overrides: list[str] | tuple = ()) -> tuple[Path, Path, Path]:
    """(training shards, zero-shot eval set, run folder), absolute: the config's own paths (relative to the
    working directory) unless --data-dir / --run-dir are given. The config with the user's --set overrides is
    validated here (ConfigError), before any data is written or a trainer launched."""
    from crate_clip.train.run.run_config import load_run_config

    cfg = load_run_config(config, overrides, check_paths=False)
    if not (cfg.data.sources and cfg.eval.evals):
        raise ValueError(f"{config}: the demo writes its data to data.sources[0] and eval.evals[0].data; fix: "
                         "give both (as configs/demo/fashion_mnist.yaml does)")
    if data_dir is not None:
        train_dir, test_dir = Path(data_dir) / "train", Path(data_dir) / "test"
    else:
        train_dir, test_dir = Path(cfg.data.sources[0]), Path(cfg.eval.evals[0].data)
    return train_dir.resolve(), test_dir.resolve(), Path(run_dir or cfg.run.output_dir).resolve()


def launch_command(config: str, nproc: int, overrides: list[str], resume: bool, overwrite: bool = False,
                   trust_checkpoint: bool = False, allow_changes: tuple = ()) -> list[str]:
    """`torchrun --nproc_per_node N -m crate_clip.train.cli ...` (torch's launcher, shipped with torch) through
    crate_clip.train.worker_launch, which exits with the trainer's own code (torchrun says 1 for any failure);
    `overwrite`: an earlier run is moved aside by the trainer (crate_clip.train.run.run_dir) before it starts;
    `trust_checkpoint`: the trainer's --trust-checkpoint; `allow_changes`: its --allow-change keys."""
    from crate_clip.train import worker_launch

    train_args = ["--config", config]
    for o in overrides:
        train_args += ["--set", o]
    for key in allow_changes:
        train_args += ["--allow-change", key]
    train_args += ((["--resume", "latest"] if resume else []) + (["--overwrite"] if overwrite else [])
                   + (["--trust-checkpoint"] if trust_checkpoint else []))
    return worker_launch.launch_command(nproc, train_args)


def summarize(run_dir: Path) -> list[dict]:
    """Print the zero-shot results of every stage's end (mid-stage ones, eval.every_samples, are in results.jsonl
    and on the curve); returns every row."""
    from crate_clip.checkpoint_io.run_layout import RESULTS_FILE, read_jsonl

    results = read_jsonl(run_dir / RESULTS_FILE)
    if not results:
        return []
    print(f"\n[demo] zero-shot top-1 on the {results[0]['n_images']:,} Fashion-MNIST test images:")
    for r in results:
        if r.get("top1") is None or r.get("at") == "mid_stage":   # skipped (its reason is in the log), mid-stage
            continue
        patch = f" / patch {r['patch_size']}" if r.get("patch_size") else ""
        how = " (grid kept, kernel PI-resized)" if r.get("resize") == "patch" else (
            " (grid grown)" if r["image_size"] != r["stage_image_size"] else "")
        ema = " (EMA weights)" if r.get("weights") == "ema" else ""
        print(f"  stage {r['stage_index']} {r['stage_name']:<8} trained at {r['stage_image_size']:>3} px, "
              f"evaluated at {r['image_size']:>3} px{patch}{how}{ema}: {100 * r['top1']:6.2f}%")
    return results


def training_flops(run_dir: Path) -> tuple[float, int, float] | None:
    """(the run's training FLOPs, its samples, the last stage's FLOPs per sample), from the step meter's records
    in metrics.jsonl (flops_per_sample of each stage x its samples)."""
    from crate_clip.train.reporting.metrics_log import METRICS_FILE, read_jsonl

    last: dict[int, dict] = {}
    for r in read_jsonl(run_dir / METRICS_FILE):
        if r.get("flops_per_sample") and r.get("samples_seen") is not None:
            last[r["stage_index"]] = r
    if not last:
        return None
    done, spent = 0, 0.0
    for index in sorted(last):
        spent += (last[index]["samples_seen"] - done) * last[index]["flops_per_sample"]
        done = last[index]["samples_seen"]
    return spent, done, last[max(last)]["flops_per_sample"]


# what a run must share with a recorded recipe for the record's figures to be its own (bench/bench_demo_recipe.py
# records these keys of the demo's stages; the studies record them for every arm)
RECIPE_KEYS = ("image_size", "patch_size", "image_mask", "image_mask_ratio", "context_length", "text_mask",
               "global_batch", "samples", "lr")


def run_recipe(stages: list[dict]) -> list[dict]:
    """The RECIPE_KEYS of a run config's stages (a stage without a patch size keeps the one set before it)."""
    recipe, patch = [], None
    for stage in stages:
        patch = stage.get("patch_size") or patch
        recipe.append({**{k: stage.get(k) for k in RECIPE_KEYS}, "patch_size": patch})
    return recipe


def _own_line(run_dir: Path, final_top1: float, recipe: list[dict]) -> str | None:
    """The run's own FLOPs and accuracy, against the same samples all at its last stage's input."""
    flops = training_flops(run_dir)
    if not flops:
        return None
    spent, samples, last = flops
    shape = (f"{recipe[-1]['image_size']} px / patch {recipe[-1]['patch_size']}, {recipe[-1]['context_length']} "
             "text tokens" if recipe else "its last stage's input")
    return (f"this run: zero-shot top-1 {100 * final_top1:.2f}% after {spent / 1e12:.2f} TFLOP of training (step "
            f"meter, {samples:,} samples), {100 * spent / (samples * last):.0f}% of what the same samples cost at "
            f"its last stage's input ({shape})")


def recipe_difference(recipe: list[dict], recorded: list[dict]) -> str | None:
    """The first way `recipe` differs from a recorded one ('stage 0 samples 640, the record's 122880'), None when it
    is the same."""
    if len(recipe) != len(recorded):
        return f"{len(recipe)} stages, the record's {len(recorded)}"
    for i, (mine, theirs) in enumerate(zip(recipe, recorded)):
        for key in RECIPE_KEYS:
            a, b = mine.get(key), theirs.get(key)
            if a != b and not (isinstance(a, float) and isinstance(b, float) and abs(a - b) <= 1e-9 * abs(b)):
                return f"stage {i} {key} {a}, the record's {b}"
    return None


def equal_flops_line(model: str, recipe: list[dict], record: Path = RECIPE_RESULTS) -> str | None:
    """bench/bench_demo_recipe.py's measurement for a run of the recorded recipe and tower: the recipe's final top-1
    over its seeds against full-resolution training of equal FLOPs; for another run, why it is not claimed."""
    rec = json.loads(record.read_text()) if record.is_file() else None
    if rec is None:
        return None
    why = (f"the record trained {rec['model']}" if rec["model"] != model
           else recipe_difference(recipe, rec["recipe"]))
    if why:
        return f"the comparison at equal FLOPs ({record.name}) is not claimed for this run: {why}"
    s, full = rec["summary"], rec["full_shape"]
    return (f"at equal FLOPs ({rec['demo_flops'] / 1e12:.2f} TFLOP): this recipe ended at {s['demo_mean']:.2f} ± "
            f"{s['demo_sd']:.2f}%, full-resolution training ({full['image_size']} px / patch {full['patch_size']}, "
            f"every image token, {rec['full_samples']:,} samples) at {s['full_mean']:.2f} ± {s['full_sd']:.2f}% "
            f"(± SD over {s['seeds']} seeds; full - this recipe {s['full_minus_demo']:+.2f} ± {s['paired_se']:.2f} "
            f"paired over images, {s['over_seeds']}; bench/bench_demo_recipe.py, {rec['date']})")


def savings_lines(run_dir: Path, final_top1: float, model: str, recipe: list[dict],
                  record: Path = RECIPE_RESULTS) -> list[str]:
    """What this run spent and scored (its step meter's FLOPs) against the same samples all at its last stage's
    input, and the recorded comparison of its recipe with full-resolution training at equal FLOPs."""
    lines = [_own_line(run_dir, final_top1, recipe), equal_flops_line(model, recipe, record)]
    return [line for line in lines if line]


def linear_probe_final(run_dir: Path, data_dir: Path, test_dir: Path, train_images: int) -> dict | None:
    """The CLIP_benchmark linear probe of the exported model: trained on the first `train_images` training
    images (their labels, written as a folder), tested on the 10,000 test images; printed and returned."""
    import torch

    from crate_clip.data.sources.fashion_mnist import write_fashion_mnist_eval_folder
    from crate_clip.eval.tasks import linear_probe
    from crate_clip.eval.model_loading import load_eval_model
    from crate_clip.models.export_files import CONFIG_FILE
    from crate_clip.train.reporting.metrics_log import log_probe

    export = export_dir(run_dir)
    if train_images <= 0 or not (export / CONFIG_FILE).is_file():
        return None
    train_dir = data_dir / f"probe_train_{train_images}"
    if not (train_dir / "classnames.txt").is_file():
        write_fashion_mnist_eval_folder(train_dir, split="train", limit=train_images)
    torch.set_num_threads(os.cpu_count() or 1)
    size = json.loads((export / CONFIG_FILE).read_text())["model_cfg"]["vision_cfg"]["image_size"]
    model, preprocess, _, _ = load_eval_model(f"local-dir:{export}", image_size=size)
    settings = linear_probe.Settings(train_data=str(train_dir), data=str(test_dir), dataset="fashion_mnist",
                                     batch_size=500)
    print(f"[demo] linear probe of the export: features of {train_images:,} training images, then the fits",
          flush=True)   # minutes on 2 cores: its bars say where it is
    metrics = linear_probe.linear_probe_evaluate(model, preprocess=preprocess, settings=settings, progress=True,
                                                 cache_dir=eval_cache_dir(run_dir))
    print(f"[demo] {linear_probe.summary(metrics)} in {metrics['extract_seconds'] + metrics['probe_seconds']:.0f} s")
    (run_dir / DEMO_PROBE_FILE).write_text(json.dumps(metrics, indent=1))
    log_probe(run_dir, metrics)   # beside the run's own numbers in TensorBoard / results.csv
    _card_with_probe(run_dir, export, metrics)
    return metrics


def _card_with_probe(run_dir: Path, export: Path, metrics: dict) -> None:
    """Rewrite the export's model card with the probe just measured on it: the card lists every measured result
    of the run, and the probe runs after the trainer wrote the export (of the run's last checkpoint)."""
    from crate_clip.checkpoint_io.atomic_files import atomic_write_text
    from crate_clip.export.writer import CARD_FILE
    from crate_clip.export.source import export_source
    from crate_clip.export.model_card import model_card
    from crate_clip.models.export_files import CONFIG_FILE

    if not checkpoints_dir(run_dir).is_dir():   # an export without its run: no training results to list beside it
        return
    config = json.loads((export / CONFIG_FILE).read_text())
    atomic_write_text(export / CARD_FILE, model_card(export_source(checkpoints_dir(run_dir)), config, probes=[metrics]))


def _run_config(config: str, overrides: list[str]) -> dict:
    """The run config the trainer ran (the file with the --set overrides), as a dict."""
    from crate_clip.train.run.run_config import load_run_config

    return load_run_config(config, overrides, check_paths=False).to_dict()


def _refused_changes(config: str, overrides: list[str], allow_changes: list[str]) -> int:
    """The exit code of a resume whose config changes what the run trains without --allow-change naming it (said
    in one line per key, as the trainer says it), else 0."""
    from crate_clip.core.errors import ConfigError, report_error
    from crate_clip.train.checkpointing.config_changes import config_changes
    from crate_clip.train.run.run_config import load_run_config

    try:
        config_changes(load_run_config(config, overrides), "latest", allow_changes)
    except ConfigError as exc:
        return report_error("crate-clip demo", exc)
    return 0


def _path_overrides(train_dir: Path, test_dir: Path, run_dir: Path) -> list[str]:
    """The trainer's --set of the demo's own folders."""
    return [f"run.output_dir={json.dumps(str(run_dir))}", f"data.sources={json.dumps([str(train_dir)])}",
            f"eval.evals.0.data={json.dumps(str(test_dir))}"]


def _check_before_launch(config: str, overrides: list[str], nproc: int, resume: bool) -> None:
    """What the trainer would refuse (batches against the processes, the run folder: --overwrite moves only a run,
    never `/`, a home folder or the data; a resume continues the run there), said before the data is written and
    any process started: a ConfigError with every problem, one line each."""
    from crate_clip.train.run.launch_checks import checked_config

    checked_config(config, overrides, world_size=nproc, overwrite=not resume, resume="latest" if resume else None,
                   data_written=False)


def main(argv=None) -> int:
    """Run the demo end to end; returns the exit code."""
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    if not args.json:
        return _demo(args)
    record: dict = {}
    with chatter_to_stderr():   # the demo's lines (and the trainer's, below) on stderr: stdout holds the result
        code = _demo(args, record)
    print(json.dumps({"exit_code": code, **record}, indent=1))
    return code


def _demo(args, record: dict | None = None) -> int:
    """The demo of the parsed command line; `record`: filled with its results (for --json)."""
    t0 = time.perf_counter()
    try:
        train_dir, test_dir, run_dir = demo_paths(args.config, args.data_dir, args.run_dir, args.overrides)
        _check_before_launch(args.config, [*_path_overrides(train_dir, test_dir, run_dir), *args.overrides],
                             args.nproc, resume=bool(args.resume and run_dir.exists()))
        prepare_data(train_dir, test_dir, args.max_train_images, args.max_test_images)
    except (FileNotFoundError, ValueError) as exc:   # no data set, a config without the demo's paths
        print(f"[demo] {exc}", file=sys.stderr)
        return EXIT_USAGE
    overrides = [*_path_overrides(train_dir, test_dir, run_dir), *args.overrides]
    # a new demo starts over: the trainer moves an earlier run aside to <run-dir>.previous (nothing is deleted)
    resume = args.resume and run_dir.exists()
    refusal = resume and _refused_changes(args.config, overrides, args.allow_changes)
    if refusal:   # before torchrun starts its workers (they check again, for a launch without the demo)
        return refusal
    cmd = launch_command(args.config, args.nproc, overrides, resume, overwrite=not resume,
                         trust_checkpoint=args.trust_checkpoint, allow_changes=tuple(args.allow_changes))
    env = dict(os.environ)   # a thread count the user set is kept; else the cores shared by the processes
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 2) // args.nproc)))
    print(f"[demo] {' '.join(cmd)}", flush=True)
    # with --json the trainer's output joins the demo's lines on stderr (descriptor 2), stdout keeps the result
    rc = subprocess.run(cmd, env=env, stdout=2 if record is not None else None).returncode
    results = summarize(run_dir)
    if rc != 0:
        # say what failed and what was kept; no plot or export lines for files a failed run did not write
        from crate_clip.checkpoint_io.checkpoint_record import latest_complete_tag
        saved = latest_complete_tag(checkpoints_dir(run_dir))   # what --resume latest takes
        kept = (f"the last checkpoint saved is {checkpoints_dir(run_dir) / saved}; `python -m crate_clip.train.demo "
                f"--resume` continues from it" if saved else "no checkpoint was saved")
        print(f"[demo] training stopped with exit code {rc} (the error is above); {kept}", file=sys.stderr)
        return rc
    probe = linear_probe_final(run_dir, train_dir.parent, test_dir, args.probe_train_images) if results else None
    final = [r for r in results if r.get("weights", "live") == "live"][-1:] or results[-1:]   # the exported weights'
    if probe:
        print(f"[demo] final model on the {final[0]['n_images']:,} test images: zero-shot top-1 "
              f"{100 * final[0]['top1']:.2f}%, "
              f"linear probe top-1 {100 * probe['top1']:.2f}% ({probe['n_train']} labelled training images)")
    cfg = _run_config(args.config, overrides)
    recipe = run_recipe(cfg["stages"])
    claims = savings_lines(run_dir, final[0]["top1"], cfg["model"]["name"], recipe) if results else []
    for line in claims:
        print(f"[demo] {line}")
    if record is not None:
        record.update(results=results, linear_probe=probe, training_flops=(training_flops(run_dir) or [None])[0],
                      claims=claims, plot=str(run_dir / PLOT_FILE), export=str(export_dir(run_dir)))
    print(f"[demo] plot: {run_dir / PLOT_FILE}\n[demo] export: {export_dir(run_dir)} "
          f"(open_clip.create_model_and_transforms('local-dir:{export_dir(run_dir)}') after `import crate_clip`)")
    print(f"[demo] finished in {time.perf_counter() - t0:.0f} s")
    return 0 if results else 1


if __name__ == "__main__":
    sys.exit(main())
