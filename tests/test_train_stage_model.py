"""One resolved stage, one model builder: the stage's settings are decided once (a patch size set by an earlier
stage included), and the planner and the step meter count FLOPs and tokens on the model the stage builds, so
they report the same numbers for every shipped config; a locked text tower's backward is counted by neither."""
import json
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from crate_clip.models import create_clip
from crate_clip.train.stage_setup.engine import DistInfo
from crate_clip.train.planning.planner import measure_stage
from crate_clip.train.plan_cli import main as plan_main
from crate_clip.train.run.run_config import config_from_dict, load_run_config
from crate_clip.train.stage_setup.stage_model import resolve_stage
from crate_clip.train.reporting.throughput import StepMeter
from crate_clip.train.loop.train_step import attention_kernel

REPO = Path(__file__).resolve().parents[1]
SHIPPED = sorted((REPO / "configs").rglob("*.yaml"))
TINY = "CRATE-alpha-CLIPA-tiny"
PLAN_GPUS = 8


def _cfg(**model):
    return config_from_dict({
        "data": {"sources": ["unused"]}, "precision": "fp32", "model": {"name": TINY, **model},
        "stages": [{"name": "low", "image_size": 21, "patch_size": 7, "context_length": 16, "samples": 32,
                    "global_batch": 16},
                   {"name": "full", "image_size": 28, "context_length": 16, "samples": 32, "global_batch": 16}]},
        check_paths=False)


def _counted(model, image_size: int, context_length: int = 16, batch: int = 2) -> float:
    """FLOPs per sample of one training step of `model` as training runs it on a CPU (the math attention kernel):
    forward, contrastive loss, backward."""
    images, tokens = torch.randn(batch, 3, image_size, image_size), torch.randint(1, 1000, (batch, context_length))
    with attention_kernel("auto", "cpu"), FlopCounterMode(display=False) as counter:
        image_f, text_f, scale = model(image=images, text=tokens)[:3]
        logits = scale * image_f @ text_f.t()
        labels = torch.arange(batch)
        ((torch.nn.functional.cross_entropy(logits, labels)
          + torch.nn.functional.cross_entropy(logits.t(), labels)) / 2).backward()
    return counter.get_total_flops() / batch


def test_a_stage_inherits_the_patch_size_and_resolves_once():
    cfg = _cfg()
    low, full = resolve_stage(cfg, 0, world_size=2), resolve_stage(cfg, 1, world_size=2)
    assert (low.patch_size, full.patch_size) == (7, 7)
    assert full.build_model().visual.trunk.patch_size == 7   # also fresh, as a resumed stage builds it
    assert (full.micro_batch, full.accumulation_steps, full.zero_stage) == (8, 1, 1)
    assert (low.counts.image_tokens, full.counts.image_tokens, full.counts.text_tokens) == (1 + 9, 1 + 16, 16)
    with pytest.raises(AttributeError):
        full.image_size = 32   # frozen: resolved once


def test_locked_text_tower_meter_flops_equal_planner_flops():
    """The planner and the meter both leave out the backward of a locked text tower (it runs under no_grad),
    and count what a model whose text weights need no gradient counts."""
    locked = resolve_stage(_cfg(lock_text=True, lock_logit_scale=True, text_pretrained="text.pt"), 0)
    meter = StepMeter(locked, DistInfo(0, 1, 0, "cpu"))
    assert meter.counts.flops == measure_stage(locked, memory=False).flops_per_sample
    torch.manual_seed(0)
    frozen = create_clip(TINY, image_size=21, context_length=16)
    frozen.visual.trunk.set_patch_size(7, "reinit")
    for name, p in frozen.named_parameters():
        p.requires_grad_(name.startswith("visual."))
    assert meter.counts.flops == _counted(frozen, 21)
    trainable = resolve_stage(_cfg(), 0).counts
    assert meter.counts.flops < trainable.flops and meter.counts.forward_flops == trainable.forward_flops


@pytest.mark.parametrize("config, changes", [
    ("crate_alpha_clipa_b-16", {}),                                        # 12 + 24 blocks, the text tower locked
    ("crate_alpha_clipa_h-14_clipa_v2", {}),                               # 32 + 24 blocks, both trainable
    ("crate_alpha_clipa_b-16", {"lock_text": "false", "image_mask": "random", "image_mask_ratio": 0.5}),
], ids=["b16-locked-text", "h14-trainable", "b16-masked"])
def test_the_cut_count_of_deep_towers_is_the_whole_models_count(config, changes):
    """planner.count_cut_per_sample, on towers cut to 1 and 2 blocks and extrapolated in depth, gives the counts of
    the whole model to the FLOP (and its tokens), for deep towers (the stages' counts use it above 4 blocks)."""
    from crate_clip.train.planning import planner

    sets = [f"{'model' if key == 'lock_text' else 'stages.0'}.{key}={value}" for key, value in changes.items()]
    cfg = load_run_config(REPO / "configs" / "datacomp" / f"{config}.yaml", sets, check_paths=False)
    stage = resolve_stage(cfg, 0)
    with torch.random.fork_rng(devices=[]):
        model = stage.build_model(read_files=False, device="meta", train=False)
        depths = [len(getattr(owner, attr)) for owner, attr in planner.tower_blocks(model)]
        cut = planner.count_cut_per_sample(model, stage.image_size, stage.context_length)
        assert [len(getattr(owner, attr)) for owner, attr in planner.tower_blocks(model)] == depths   # put back
        whole = planner.count_per_sample(model, stage.image_size, stage.context_length)
    assert min(depths) > planner.CUT_ABOVE_BLOCKS and cut == whole and whole.forward_flops > 0
    assert (whole.grad_forward_flops < whole.forward_flops) == cfg.model.lock_text


@pytest.mark.slow
@pytest.mark.parametrize("config", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_plan_and_step_meter_report_the_same_flops_for_every_shipped_stage(config, capsys):
    # --no-memory: the activation trace does not touch the FLOP count
    assert plan_main([str(config), "--gpus", str(PLAN_GPUS), "--gpu", "h100", "--json", "--no-memory"]) == 0
    plans = json.loads(capsys.readouterr().out)
    cfg = load_run_config(config, check_paths=False)
    assert len(plans) == len(cfg.stages)
    for i, plan in enumerate(plans):
        meter = StepMeter(resolve_stage(cfg, i, PLAN_GPUS), DistInfo(0, PLAN_GPUS, 0, "cpu"))
        assert plan["flops_per_sample"] == meter.record().flops_per_sample, (config.name, i)
    if cfg.model.lock_text:   # the paper's recipe: the CLIPA text tower frozen, its backward never runs
        trainable = cfg.model_copy(update={"model": cfg.model.model_copy(update={"lock_text": False})})
        assert plans[0]["flops_per_sample"] < 0.9 * resolve_stage(trainable, 0).counts.flops


def test_plan_reports_a_batch_that_does_not_split_over_the_gpus(capsys):
    demo = str(REPO / "configs" / "demo" / "fashion_mnist.yaml")
    assert plan_main([demo, "--gpus", "3", "--gpu", "h100"]) == 2
    err = capsys.readouterr().err
    assert "stages.0.global_batch: 64 is not divisible by the 3 processes; fix:" in err and "Traceback" not in err
    assert plan_main([demo, "--gpus", "2"]) == 2 and "--gpu-memory: required" in capsys.readouterr().err


def test_a_compiled_stage_says_so_and_its_plan_counts_the_compile(capsys):
    """Issue 55 item 1: each stage's one line says whether it compiles its towers and why; the plan adds the
    compile (each stage compiles afresh) to a compiled stage's time, and only to a compiled one's."""
    from crate_clip.train.planning.plan_inputs import COMPILE_S_PER_STAGE
    from crate_clip.train.stage_setup.stage_model import compile_line

    eager, compiled = _cfg(), _cfg(compile=True)
    line = compile_line(resolve_stage(eager, 0), "cpu")
    assert line.startswith("[compile] stage low: eager (model.compile: false)") and "bench_compile.py" in line
    assert "not measured on a GPU" in compile_line(resolve_stage(eager, 0), "cuda:0")
    assert compile_line(resolve_stage(compiled, 1), "cpu").startswith(
        "[compile] stage full: both towers compiled (model.compile: true)")
    plans = {}
    for name, cfg in (("eager", eager), ("compiled", compiled)):
        stages = [resolve_stage(cfg, i, 1) for i in range(2)]
        plans[name] = [planner_plan(s) for s in stages]
    for before, after in zip(plans["eager"], plans["compiled"]):
        assert (before.compile_s, after.compile_s) == (0.0, COMPILE_S_PER_STAGE)
        assert after.wall_hours * 3600 == pytest.approx(before.wall_hours * 3600 + COMPILE_S_PER_STAGE)
        assert after.mfu == before.mfu   # the rate is the same; the compile is time on top of it
    from crate_clip.train.planning.planner import format_plan
    text = format_plan(plans["compiled"], 1, 80 * 2 ** 30, "h100", 0.4, 1, "fp32")
    assert text.count(f"the time includes {COMPILE_S_PER_STAGE:.0f} s of compiling (model.compile") == 2


def planner_plan(stage):
    from crate_clip.train.planning.planner import gpu_peak_tflops, plan_stage
    return plan_stage(stage, measure_stage(stage, memory=False), 80 * 2 ** 30, gpu_peak_tflops("h100"), 0.4)
