"""The planner's time counts the forward that runs again (checkpoint recompute, the accumulation's grad pass) as
the part of the forward autograd records: a locked text tower's no-grad forward runs once per sample whatever
the accumulation k and checkpointing, so the paper's L/14 recipe on 64 H100s as first shipped was ~629 GPU-hours,
not 671 (507 tuned to 80 GB; 525 with issue 53's step margin and headroom)."""
import json
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from crate_clip.train.plan_cli import main as plan_main
from crate_clip.train.planning.plan_inputs import Efficiency
from crate_clip.train.planning.planner import SAMPLE_OBJECT_BYTES, format_plan, measure_stage, plan_stage
from crate_clip.train.run.run_config import config_from_dict
from crate_clip.train.stage_setup.stage_model import resolve_stage

REPO = Path(__file__).resolve().parents[1]
TINY = "CRATE-alpha-CLIPA-tiny"


def _cfg(micro_batch=16, ckpt=False, **model):
    return config_from_dict({
        "data": {"sources": ["unused"]}, "precision": "fp32",
        "model": {"name": TINY, "grad_checkpointing": ckpt, **model},
        "stages": [{"name": "s", "image_size": 28, "context_length": 16, "samples": 64, "global_batch": 16,
                    "micro_batch": micro_batch}]}, check_paths=False)


LOCKED = {"lock_text": True, "lock_logit_scale": True, "text_pretrained": "text.pt"}


def _text_forward_flops(batch: int = 2) -> float:
    """FLOPs per sample of the tiny model's text tower forward alone (meta device)."""
    model = resolve_stage(_cfg(), 0).build_model(read_files=False, device="meta", train=False)
    tokens = torch.ones(batch, 16, dtype=torch.long, device="meta")
    with FlopCounterMode(display=False) as counter:
        model.encode_text(tokens, normalize=True)
    return counter.get_total_flops() / batch


def test_the_no_grad_share_of_the_forward_is_the_locked_text_tower():
    trainable, locked = resolve_stage(_cfg(), 0).counts, resolve_stage(_cfg(**LOCKED), 0).counts
    assert trainable.grad_forward_flops == trainable.forward_flops   # everything records: all of it runs again
    assert locked.forward_flops == trainable.forward_flops
    assert locked.forward_flops - locked.grad_forward_flops == pytest.approx(_text_forward_flops(), rel=1e-9)


@pytest.mark.parametrize("micro_batch,ckpt", [(16, False), (8, False), (16, True), (4, True)])
def test_a_locked_tower_runs_forward_once_whatever_k_and_checkpointing(micro_batch, ckpt):
    locked = resolve_stage(_cfg(micro_batch, ckpt, **LOCKED), 0)
    m = measure_stage(locked, memory=False)
    plan = plan_stage(locked, m, 80 * 2 ** 30, 989.0, 0.4)
    k = 16 // micro_batch
    repeats = (k > 1) + ckpt
    assert plan.accumulation_steps == k and plan.grad_checkpointing == ckpt
    assert plan.repeated_flops_per_sample == m.grad_forward_flops_per_sample * repeats
    assert plan.total_flops == (m.flops_per_sample + m.grad_forward_flops_per_sample * repeats) * 64
    # the text forward is inside flops_per_sample once, and never in what runs again
    text = m.forward_flops_per_sample - m.grad_forward_flops_per_sample
    assert text == pytest.approx(_text_forward_flops(), rel=1e-9) and text > 0
    assert plan.total_flops < (m.flops_per_sample + m.forward_flops_per_sample * repeats) * 64 or repeats == 0


def test_the_time_assumes_hfu_or_mfu_and_derives_the_other():
    """Issue 53: an HFU is a rate on the executed FLOPs (the recomputed forward included), an MFU on the model FLOPs
    alone (the training meter's); either one times the stage, the other is derived, and the two differ by the
    recomputed share."""
    locked = resolve_stage(_cfg(4, True, **LOCKED), 0)   # k = 4 and checkpointing: the forward runs again twice
    m = measure_stage(locked, memory=False)
    by_hfu = plan_stage(locked, m, 80 * 2 ** 30, 989.0, Efficiency("hfu", 0.4))
    by_mfu = plan_stage(locked, m, 80 * 2 ** 30, 989.0, Efficiency("mfu", 0.4))
    assert plan_stage(locked, m, 80 * 2 ** 30, 989.0, 0.4).gpu_hours == by_hfu.gpu_hours   # a number: an HFU
    executed, model = by_hfu.total_flops, by_hfu.model_flops
    assert model == m.flops_per_sample * 64 and executed > 1.2 * model
    assert by_hfu.gpu_hours == pytest.approx(executed / (989e12 * 0.4) / 3600)
    assert by_mfu.gpu_hours == pytest.approx(model / (989e12 * 0.4) / 3600)
    assert (by_hfu.hfu, by_hfu.mfu) == (0.4, pytest.approx(0.4 * model / executed))
    assert (by_mfu.mfu, by_mfu.hfu) == (0.4, pytest.approx(0.4 * executed / model))
    head = format_plan([by_hfu], 1, 80 * 2 ** 30, "h100", Efficiency("hfu", 0.4), 1, "fp32").splitlines()[0]
    assert f"HFU 40% (assumed: executed FLOPs, recomputation included) -> MFU {0.4 * model / executed:.1%}" in head
    head = format_plan([by_mfu], 1, 80 * 2 ** 30, "h100", Efficiency("mfu", 0.4), 1, "fp32").splitlines()[0]
    assert f"MFU 40% (assumed: model FLOPs, as the training meter counts them) -> HFU {0.4 * executed / model:.1%}" \
        in head


def test_the_paper_l14_recipe_on_64_h100s_plans_at_most_540_gpu_hours(capsys):
    config = str(REPO / "configs" / "datacomp" / "crate_alpha_clipa_l-14.yaml")
    assert plan_main([config, "--gpus", "64", "--gpu", "h100", "--json", "--no-memory"]) == 0
    plans = json.loads(capsys.readouterr().out)
    flops = [(p["flops_per_sample"] / 1e9, p["repeated_flops_per_sample"] / 1e9) for p in plans]
    # the tuned config (plan --tune at 79 GiB with the step margin and the headroom): nothing recomputed at 84 px,
    # 12 of 24 image blocks at 224 px
    assert flops[0] == (pytest.approx(120.5, abs=0.1), 0.0)
    assert flops[1] == (pytest.approx(738.0, abs=0.1), pytest.approx(239.8 * 12 / 24, abs=0.3))
    assert sum(p["gpu_hours"] for p in plans) == pytest.approx(525, abs=1) and sum(p["gpu_hours"] for p in plans) <= 540
    # at the default HFU 40% (executed FLOPs): the MFU (model FLOPs) is 40% at 84 px, 34.4% at 224 px, 36.7% in all
    assert [p["efficiency_assumed"] for p in plans] == ["hfu", "hfu"] and [p["hfu"] for p in plans] == [0.4, 0.4]
    assert [p["mfu"] for p in plans] == [0.4, pytest.approx(0.4 * 738.0 / (738.0 + 119.9), abs=2e-4)]
    time = sum(p["total_flops"] / p["hfu"] for p in plans)
    assert sum(p["model_flops"] for p in plans) / time == pytest.approx(0.367, abs=5e-4)
    # one 250,000-sample buffer a host of 8 ranks: 64 streams of 3,906 raw samples, 8.4 GiB (at most 16 GiB)
    assert {(p["loader_streams"], p["shuffle_buffer"]) for p in plans} == {(8, 3_906)}
    buffers = 64 * 3_906 * (36_000 + SAMPLE_OBJECT_BYTES)   # a raw sample: its members and its Python objects
    assert {p["host_bytes"]["shuffle buffers"] for p in plans} == {buffers} and buffers < 16 * 2 ** 30
