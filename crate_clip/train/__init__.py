"""CLIPA-style multi-stage training under DeepSpeed ZeRO.

Subpackages by concern, from the bottom up: each imports only those above it in this list (the order is
tests/test_architecture_imports.py's TRAIN_LAYERS; docs/layout.md has a row for each):
planning/       no torch: memory fit, micro-batch, FLOP and token counts, wall time and GPU-hours of a stage
                (plan_inputs.py, planner.py)
run/            the run config (YAML, `--set`, validation), the checks before launch, the output folder and its lock,
                the launcher watchdog and /proc, a full disk said in one line (run_config.py, launch_checks.py,
                run_dir.py, run_lock.py, process_info.py, launcher_watch.py, save_signals.py, disk_space.py)
reporting/      the step meter, progress bar, trackers, metrics.jsonl / results.jsonl, the PNG curve, white-box
                diagnostics, DeepSpeed's output (throughput.py, progress_display.py, trackers.py, metrics_log.py,
                training_curve.py, whitebox_log.py, deepspeed_output.py)
stage_setup/    what one stage trains: ResolvedStage and the one model builder, the locked text tower, AdamW groups
                and schedule, the process group and DeepSpeed engine (stage_model.py, text_lock.py, optim.py,
                engine.py)
checkpointing/  atomic, verified, resumable DeepSpeed checkpoints and their records, resume at another world size or
                ZeRO stage, what a resume changed of the run config (checkpoints.py, elastic_resume.py,
                config_changes.py)
loop/           one optimizer step, batches fetched in agreement, stop requests, the evaluations after a stage, and
                the run from the entry point down (train_step.py, batch_agreement.py, stop_requests.py, stop_sharing.py,
                stage_evals.py, stage_loop.py)
the entry layer, these modules (`python -m crate_clip.train.cli` is what torchrun starts):
cli.py           `crate-clip train`;  plan_cli.py: `crate-clip plan`;  demo.py: the README's first command;
worker_launch.py the torchrun launch of cli.py's workers
python_api.py    `crate_clip.train.run(config) -> RunResult`: the Python API (docs/python_api.md)
"""
import importlib
import types

from crate_clip.train import run as _run_package

_API_MODULE = "crate_clip.train.python_api"   # imported on first use: torch, DeepSpeed and open_clip take seconds


class _CallableRunPackage(types.ModuleType):
    """`crate_clip.train.run` is the run/ subpackage (config, folder, lock: 65 modules import it by that name) and,
    called, the Python API: `crate_clip.train.run(config, ...)` is python_api.run, what `crate-clip train` does in
    this process, returning a RunResult (docs/python_api.md). A function of that name here would be replaced by
    the subpackage as soon as anything imported it, so the subpackage's module is made callable instead."""

    def __call__(self, config, **options):
        """python_api.run(config, **options): train `config` in this process; returns a RunResult."""
        return importlib.import_module(_API_MODULE).run(config, **options)


_run_package.__class__ = _CallableRunPackage


def __getattr__(name: str):
    """RunResult and the exit-reason exceptions of the Python API, from python_api on first use."""
    if name in ("RunResult", "InputError", "SourceUnavailableStop", "PreemptedStop"):
        return getattr(importlib.import_module(_API_MODULE), name)
    raise AttributeError(f"module 'crate_clip.train' has no attribute {name!r}")
