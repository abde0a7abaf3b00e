"""`crate-clip plan CONFIG --gpus N --gpu-memory 80GiB [--gpu h100] [--hfu 0.4 | --mfu 0.38] [--json]`: fit and
time a run;
`crate-clip plan --resume RUN_DIR --gpus N ...`: the same for the rest of a run in progress, resumed on N GPUs."""
from __future__ import annotations

import argparse
import json
import sys

from crate_clip.core.cli_conventions import CommandParser
from crate_clip.core.errors import ConfigError, report_error
from crate_clip.train.planning.plan_inputs import DEFAULT_HFU, GPU_TABLE, Efficiency, parse_bytes

PROG = "crate-clip plan"


def _positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: at least 1 GPU")
    return value


def _fraction(name: str):
    """argparse type: a utilisation (`name`: MFU or HFU) in (0, 1]."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not 0 < value <= 1:
            raise argparse.ArgumentTypeError(f"{text}: {name} is a fraction of the peak in (0, 1], e.g. 0.4 for 40%")
        return value
    return parse


def _gpu_memory(text: str) -> int:
    """argparse type: a memory size with a unit, more than 0."""
    try:
        value = parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: the memory per GPU must be more than 0")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The `crate-clip plan` argument parser."""
    p = CommandParser(prog=PROG,
                      description="Per stage: parameters, counted FLOPs, per-rank memory, the largest "
                                  "micro-batch that fits, accumulation steps, wall time and GPU-hours.")
    p.add_argument("config", nargs="?", default=None,
                   help="run config YAML (with --resume: default the checkpoint's own run config)")
    p.add_argument("--resume", default=None, metavar="RUN_DIR|CHECKPOINT",
                   help="plan the rest of a run in progress as it would resume on --gpus GPUs: its newest complete "
                        "checkpoint (or the one named), read from its JSON files")
    p.add_argument("--gpus", type=_positive_int, required=True, help="number of GPUs (ranks), at least 1")
    p.add_argument("--gpu-memory", type=_gpu_memory, default=None,
                   help="memory per GPU, e.g. 80GiB, 141G, 512MiB (default: the --gpu's)")
    p.add_argument("--gpu", default=None, help=f"GPU type for the bf16 peak: {', '.join(GPU_TABLE)}")
    speed = p.add_mutually_exclusive_group()
    speed.add_argument("--hfu", type=_fraction("HFU"), default=None,
                       help="hardware FLOPs utilisation assumed for time, in (0, 1]: the fraction of the peak on the "
                            "executed FLOPs (model FLOPs + the forward recomputed or run again for accumulation); "
                            f"the plan prints the MFU that results (default: {DEFAULT_HFU})")
    speed.add_argument("--mfu", type=_fraction("MFU"), default=None,
                       help="model FLOPs utilisation assumed for time instead, in (0, 1]: the fraction of the peak on "
                            "the model FLOPs alone, as metrics.jsonl's mfu and bench/bench_gpu.py measure it; the "
                            "plan prints the HFU that needs")
    p.add_argument("--config", dest="config_option", default=None, metavar="CONFIG",
                   help="the run config YAML, as `crate-clip train --config` takes it (same as the positional)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set stages.0.global_batch=4096 (repeatable), as train does")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.add_argument("--host-memory", type=_gpu_memory, default=None,
                   help="host memory a node, e.g. 512GiB: a plan whose loaders (shuffle buffers, decode workers, "
                        "batches in flight) need more is refused (exit 2)")
    p.add_argument("--gpus-per-node", type=_positive_int, default=8,
                   help="GPUs (ranks) a node, sharing its host memory (default 8, at most --gpus)")
    p.add_argument("--tune", action="store_true",
                   help="choose, stage by stage, the fastest settings that fit: the image-tower blocks recomputed, "
                        "micro-batch and accumulation, ZeRO stage; print what they save")
    p.add_argument("--write-config", default=None, metavar="OUT.yaml",
                   help="with --tune: write the run config with the chosen settings to OUT.yaml")
    p.add_argument("--no-memory", action="store_true",
                   help="skip the activation trace (seconds per stage): FLOPs, time and "
                        "GPU-hours at the run config's micro-batch, not checked to fit")
    return p


def plan_stages(config: str, overrides: list[str], gpus: int, per_node: int = 8) -> list:
    """The run's stages resolved for `gpus` ranks, `per_node` a node (what training resolves, without a device's
    micro_batch auto)."""
    from crate_clip.train.run.run_config import check_runtime, load_run_config
    from crate_clip.train.stage_setup.stage_model import resolve_stage

    cfg = load_run_config(config, overrides, check_paths=False)
    check_runtime(cfg, gpus, "cuda")   # the batches must split over the GPUs, as training checks it
    return [resolve_stage(cfg, i, gpus, ranks_per_host=min(per_node, gpus)) for i in range(len(cfg.stages))]


def write_tuned_config(config: str, overrides: list[str], plans: list, out: str, header: str) -> None:
    """The run config (with its --set overrides) and the tune's choices, as YAML at `out`."""
    import os
    from pathlib import Path

    import yaml

    from crate_clip.core.safe_yaml import load_yaml_file
    from crate_clip.train.run.run_config import apply_override

    raw = load_yaml_file(config) or {}
    for assignment in overrides:
        apply_override(raw, assignment)
    for stage, plan in zip(raw.get("stages", []), plans):
        stage.update(micro_batch=plan.micro_batch, checkpoint_blocks=plan.checkpoint_blocks)
    model = raw.setdefault("model", {})
    # the text tower is recomputed under model.grad_checkpointing: only where a stage recomputes the image tower
    # and the text tower trains (a locked one saves nothing to recompute)
    model["grad_checkpointing"] = not model.get("lock_text", False) and any(p.checkpoint_blocks for p in plans)
    ds = raw.setdefault("deepspeed", {})
    ds["zero_stage"] = plans[0].zero_stage
    if ds.get("config") and not os.path.isabs(ds["config"]):   # relative to the run config: keep it pointing there
        ds["config"] = os.path.relpath(Path(config).resolve().parent / ds["config"], Path(out).resolve().parent)
    Path(out).write_text(header + yaml.safe_dump(raw, sort_keys=False))


def plan_resume(resume: str, config: str | None, overrides: list[str], gpus: int,
                per_node: int = 8) -> tuple[dict, list]:
    """(how the run in progress would resume on `gpus` ranks, `per_node` a node, its remaining stages resolved for
    them)."""
    from crate_clip.checkpoint_io.checkpoint_choice import PLAN, choose_checkpoint
    from crate_clip.checkpoint_io.checkpoint_record import INFO_FILE, read_record
    from crate_clip.checkpoint_io.run_layout import run_dir_of
    from crate_clip.train.checkpointing.checkpoints import ResumeError
    from crate_clip.train.checkpointing.config_changes import recorded_config
    from crate_clip.train.checkpointing.elastic_resume import launch_stream_settings, resume_summary
    from crate_clip.train.run.run_config import apply_override, check_runtime, config_from_dict, load_run_config
    from crate_clip.train.stage_setup.stage_model import resolve_stage

    tag_dir = choose_checkpoint(resume, PLAN, error=ResumeError).tag_dir
    if config is not None:
        cfg = load_run_config(config, overrides, check_paths=False)
    else:   # the run's recorded config with the changes its resumes made, else the checkpoint's (found complete)
        raw = recorded_config(run_dir_of(tag_dir)) or read_record(tag_dir).run_config
        for assignment in overrides:
            apply_override(raw, assignment)
        cfg = config_from_dict(raw, check_paths=False, source_path=str(tag_dir / INFO_FILE))
    check_runtime(cfg, gpus, "cuda")
    summary = resume_summary(tag_dir, cfg, gpus)
    hosts = min(per_node, gpus)
    stream = launch_stream_settings(cfg, gpus, tag_dir, summary["stage_index"], hosts)   # as the launch settles them
    return summary, [resolve_stage(cfg, i, gpus, ranks_per_host=hosts, stream=stream)
                     for i in range(summary["stage_index"], len(cfg.stages))]


def format_resume(s: dict) -> str:
    """The lines `crate-clip plan --resume` prints above the plan."""
    return (f"resume: {s['checkpoint']} (stage {s['stage_index']} {s['stage_name']}, step {s['step']} of "
            f"{s['stage_steps']}, global step {s['global_step']}; written by {s['written_by']} processes under "
            f"ZeRO-{s['written_zero_stage']})\n"
            f"  on {s['world_size']} GPUs: ZeRO-{s['zero_stage']}, canonical streams {s['canonical_streams']} "
            f"({s['canonical_streams'] // s['world_size']} per rank), DeepSpeed universal checkpoint: {s['universal']}")


def main(argv=None) -> int:
    """Run `crate-clip plan`; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.config_option is not None:   # `plan --config FILE`, as `train --config FILE`
        if args.config is not None:
            parser.error("give the run config once: as the positional or with --config")
        args.config = args.config_option
    # the planner's modules (torch, open_clip, DeepSpeed: seconds of CPU) after parsing: --help stays instant
    from crate_clip.train.checkpointing.checkpoints import ResumeError
    from crate_clip.train.planning.planner import (format_plan, format_tune, plan_run, plans_as_dicts, tune_run,
                                                   unfit_line)

    gpu_key = (args.gpu or "").lower()
    try:
        if args.gpu_memory is None and gpu_key not in GPU_TABLE:
            raise ConfigError(f"--gpu-memory: required unless --gpu names a known GPU ({', '.join(GPU_TABLE)})")
        if args.config is None and args.resume is None:
            raise ConfigError("give a run config, or --resume RUN_DIR for a run in progress")
        if args.write_config and not (args.tune and args.config):
            raise ConfigError("--write-config: give it with --tune and a run config")
        if args.tune and args.no_memory:
            raise ConfigError("--tune: fits need the activation trace; drop --no-memory")
        summary = None
        if args.resume is not None:
            summary, stages = plan_resume(args.resume, args.config, args.overrides, args.gpus, args.gpus_per_node)
        else:
            stages = plan_stages(args.config, args.overrides, args.gpus, args.gpus_per_node)
    except (ConfigError, ResumeError) as exc:
        return report_error(PROG, exc)
    memory = args.gpu_memory or GPU_TABLE[gpu_key][1] * 2 ** 30
    efficiency = Efficiency("mfu", args.mfu) if args.mfu is not None else Efficiency("hfu", args.hfu or DEFAULT_HFU)
    if args.tune:
        plans, configured = tune_run(stages, memory, args.gpu, efficiency)
    else:
        plans, configured = plan_run(stages, memory, args.gpu, efficiency, memory=not args.no_memory), None
    unfit = unfit_line(plans, memory, args.host_memory)
    if unfit:   # one line, exit 2: the stage, the memory short, a setting that fits
        return report_error(PROG, ConfigError(unfit))
    if args.write_config:
        write_tuned_config(args.config, args.overrides, plans, args.write_config,
                           f"# {args.config} tuned by `crate-clip plan --tune --gpus {args.gpus}` for "
                           f"{args.gpus} x {args.gpu or _fmt_memory(memory)} GPUs\n")
    if args.json:
        rows = plans_as_dicts(plans)
        print(json.dumps({"resume": summary, "stages": rows} if summary else rows, indent=1))
    else:
        print((format_resume(summary) + "\n" if summary else "")
              + format_plan(plans, args.gpus, memory, args.gpu, efficiency, plans[0].zero_stage, stages[0].precision)
              + ("\n" + format_tune(plans, configured) if configured else "")
              + (f"\nwrote {args.write_config}" if args.write_config else ""))
    return 0


def _fmt_memory(n: int) -> str:
    return f"{n / 2 ** 30:.0f} GiB"


if __name__ == "__main__":
    sys.exit(main())
