"""The planner: counted FLOPs, per-rank state under ZeRO, and its memory prediction against the real peak
of a training step on CPU (the resident memory the steps add to a process, forked from the suite's warm interpreter:
measured 5% above a fresh interpreter's, 389 against 370 MB, both within the 20% the prediction is held to)."""
import json
import sys

import pytest

import warm_python
from crate_clip.train.stage_setup.stage_model import resolve_stage
from train_fixtures import REPO_ROOT, run_env, tiny_clip_params, tiny_text_params

PEAK_SCRIPT = r"""
import ctypes, json, resource, sys, torch
# a fixed mmap threshold (M_MMAP_THRESHOLD, as $MALLOC_MMAP_THRESHOLD_ sets at start-up): glibc then returns freed
# tensors (>= 64 KiB) to the system, as a GPU caching allocator reuses them; with its default dynamic threshold,
# heap fragmentation adds ~50% on top
assert ctypes.CDLL("libc.so.6").mallopt(-3, 65536) == 1
import crate_clip
from crate_clip.train.run.run_config import config_from_dict
from crate_clip.train.stage_setup.stage_model import resolve_stage
cfg = config_from_dict(json.loads(sys.argv[1]), check_paths=False)
stage, batch = resolve_stage(cfg, 0), int(sys.argv[2])
torch.manual_seed(0)
images = torch.randn(batch, 3, stage.image_size, stage.image_size)
tokens = torch.randint(1, 1000, (batch, stage.context_length))
model = stage.build_model(read_files=False).train()
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize()
base = rss()
# the peak of the training steps alone, sampled by a thread: the process's lifetime peak (ru_maxrss) also
# holds whatever import and model building touched before `base`, which varies from machine to machine
import threading, time
peak, running = [base], [True]
def sample():
    while running[0]:
        peak[0] = max(peak[0], rss())
        time.sleep(0.0005)
sampler = threading.Thread(target=sample, daemon=True)
sampler.start()
for _ in range(2):
    image_f, text_f, scale = model(image=images, text=tokens)[:3]
    logits = scale * image_f @ text_f.t()
    labels = torch.arange(batch)
    loss = (torch.nn.functional.cross_entropy(logits, labels) + torch.nn.functional.cross_entropy(logits.t(), labels)) / 2
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    del image_f, text_f, scale, logits, loss
running[0] = False
sampler.join()
print("PEAK", json.dumps({"delta": peak[0] - base, "lifetime_delta": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base}))
"""


def _meta_model(cfg):
    """The stage's model as training builds it, shapes only."""
    return resolve_stage(cfg, 0).build_model(read_files=False, device="meta")


def _cfg(image_size=32, batch=128, ckpt=False):
    return {"data": {"sources": ["unused"]}, "precision": "fp32", "deepspeed": {"zero_stage": 1},
            "model": {"name": "CRATE-alpha-CLIPA-tiny", "grad_checkpointing": ckpt},
            "stages": [{"name": "s", "image_size": image_size, "context_length": 16, "samples": batch,
                        "global_batch": batch, "lr": 1e-3}]}


def test_state_bytes_follow_the_zero_stage():
    from crate_clip.train.planning.planner import state_bytes_per_rank

    z1 = state_bytes_per_rank(100, 20, "bf16", 1, 4)
    # ZeRO-1/2: the gradients and DeepSpeed's reduce bucket (here the 100 trainable, the bucket being larger)
    assert z1 == {"weights": 240, "grads": 200 + 200, "optimizer": 300}
    assert state_bytes_per_rank(100, 20, "bf16", 2, 4)["grads"] == 50 + 200
    z3 = state_bytes_per_rank(100, 20, "bf16", 3, 4)
    assert z3 == {"weights": 60, "grads": 50, "optimizer": 300}
    # DeepSpeed's ZeRO keeps an fp32 master partition of fp32 weights too; without ZeRO, AdamW's m and v alone
    assert state_bytes_per_rank(100, 0, "fp32", 0, 4) == {"weights": 400, "grads": 400, "optimizer": 800}
    assert state_bytes_per_rank(100, 0, "fp32", 2, 4)["optimizer"] == 100 * 12 / 4


def test_a_locked_text_tower_counts_as_frozen_and_is_held_whole_by_every_rank():
    """text_lock keeps the locked tower's weights as fp32 buffers: the planner counts them (frozen) and gives
    every rank all of them, as ZeRO partitions parameters only."""
    from crate_clip.train.planning.planner import locked_buffer_params, state_bytes_per_rank
    from crate_clip.train.run.run_config import config_from_dict

    raw = _cfg(16)
    raw["model"].update(lock_text=True, text_pretrained="text.pt")
    cfg = config_from_dict(raw, check_paths=False)
    assert locked_buffer_params(_meta_model(cfg)) == tiny_text_params(16)
    assert locked_buffer_params(_meta_model(config_from_dict(_cfg(16), check_paths=False))) == 0
    assert state_bytes_per_rank(100, 20, "bf16", 3, 4, locked=10)["weights"] == 60 + 40


def test_flops_are_counted_and_scale_with_tokens():
    from crate_clip.train.planning.planner import measure_stage
    from crate_clip.train.run.run_config import config_from_dict

    small = config_from_dict(_cfg(16), check_paths=False)
    large = config_from_dict(_cfg(32), check_paths=False)
    m16, m32 = measure_stage(resolve_stage(small, 0)), measure_stage(resolve_stage(large, 0))
    assert m16.trainable_params == tiny_clip_params(16, 16) and m16.frozen_params == 0
    assert m32.trainable_params - m16.trainable_params == (8 * 8 - 4 * 4) * 128   # pos-embed rows x width
    # 4x the image tokens: the image tower's FLOPs grow about 4x, the text tower's stay
    assert 1.5 < m32.flops_per_sample / m16.flops_per_sample < 4.5
    assert m32.forward_flops_per_sample < m32.flops_per_sample / 2
    assert m32.activation_bytes_per_sample > 2 * m16.activation_bytes_per_sample * 0.9
    assert m32.activation_bytes_per_sample_ckpt < m32.activation_bytes_per_sample


def test_depth_cut_trace_matches_the_full_trace():
    """The planner traces towers cut to 1 and 2 blocks and extrapolates by depth; the tiny model (4 image
    blocks, 2 text blocks) traced at full depth gives the same FLOPs and activations (with the cycle
    collector paused during a trace, both are deterministic)."""
    from crate_clip.train.planning.planner import measure_stage
    from crate_clip.train.run.run_config import config_from_dict

    stage = resolve_stage(config_from_dict(_cfg(32, 8), check_paths=False), 0)
    cut, full = measure_stage(stage, full_depth=False), measure_stage(stage, full_depth=True)
    for key in ("trainable_params", "frozen_params", "flops_per_sample", "forward_flops_per_sample",
                "activation_bytes_per_sample", "activation_bytes_per_sample_ckpt", "activation_bytes_fixed"):
        assert getattr(cut, key) == pytest.approx(getattr(full, key), rel=0.01), key
    assert cut.activation_bytes_per_sample_ckpt < 0.8 * cut.activation_bytes_per_sample


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_fake_tensor_trace_holds_the_bytes_of_a_real_cpu_step(precision):
    """The planner runs its traced step on fake tensors (no values computed); the same step on real CPU
    tensors holds the same bytes at every batch, with and without checkpointing: the CPU's fused attention
    kernel, and in bf16 the locked text tower's autocast (its weights cast at each call)."""
    import torch

    from crate_clip.train.planning.planner import _peak_bytes, _trace, older_objects_frozen
    from crate_clip.train.run.run_config import config_from_dict

    raw = dict(_cfg(28), precision=precision)
    raw["model"].update(lock_text=True, text_pretrained="text.pt")
    stage = resolve_stage(config_from_dict(raw, check_paths=False), 0)
    fake = _trace(stage.build_model(read_files=False, device="meta", train=False), stage, (2, 4))
    model, real = stage.build_model(read_files=False, train=False).train(), {}
    with older_objects_frozen():   # as _trace's passes: each collects its own garbage only
        for ckpt in (False, True):
            model.set_grad_checkpointing(ckpt)
            for b in (1, 2, 4):
                images, tokens = torch.randn(b, 3, 28, 28), torch.randint(1, 1000, (b, 16))
                real[f"{'ckpt' if ckpt else 'peak'}{b}"] = _peak_bytes(model, images, tokens, None,
                                                                      track_memory=b > 1)
    assert fake == {key: value for key, value in real.items() if not key.endswith("1")}


@pytest.mark.slow
def test_memory_prediction_matches_the_real_cpu_peak():
    from crate_clip.train.planning.planner import logits_bytes, measure_stage, state_bytes_per_rank
    from crate_clip.train.run.run_config import config_from_dict

    raw, batch = _cfg(32, 128), 128
    m = measure_stage(resolve_stage(config_from_dict(raw, check_paths=False), 0))
    state = state_bytes_per_rank(m.trainable_params, m.frozen_params, "fp32", 0, 1)
    # the process already holds the weights when the baseline is read
    predicted = (state["grads"] + state["optimizer"] + m.activation_bytes_fixed
                 + m.activation_bytes_per_sample * batch + logits_bytes(batch, batch))
    proc = warm_python.run([sys.executable, "-c", PEAK_SCRIPT, json.dumps(raw), str(batch)], env=run_env(),
                           cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    real = json.loads(proc.stdout.split("PEAK", 1)[1])["delta"]
    assert abs(predicted - real) / real < 0.20, (predicted, real, proc.stdout)
