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
"""
