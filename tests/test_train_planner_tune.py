"""`crate-clip plan --tune`, the host-memory plan and the one definition of the stream settings: the tune recomputes
the fewest image blocks that fit, writes a config that plans the same, a plan that does not fit is one line (exit
2), and the shuffle buffer a host shares is split over its streams once, at the first launch, and kept on resume."""
import json
from dataclasses import replace

import pytest
import torch
import yaml

from crate_clip.data.stream_layout import stream_settings
from crate_clip.train.checkpointing.elastic_resume import launch_stream_settings
from crate_clip.train.plan_cli import main as plan_main
from crate_clip.train.planning.planner import (CUDA_CONTEXT_BYTES, RAW_SAMPLE_BYTES, SAMPLE_OBJECT_BYTES,
                                               STEP_MARGIN, fit_budget, gpu_memory_for, measure_stage,
                                               plan_stage)
from crate_clip.train.run.run_config import config_from_dict, load_run_config
from crate_clip.train.stage_setup.stage_model import resolve_stage

TINY = "CRATE-alpha-CLIPA-tiny"
# a GPU that fits a step planned at 27 MiB (with the margin; less the reserve, the CUDA context and the headroom)
GPU_27_MIB_FREE = str(int(gpu_memory_for(27 * 2 ** 20 + CUDA_CONTEXT_BYTES)) + 1)
LOCKED = {"lock_text": True, "lock_logit_scale": True, "text_pretrained": "text.pt"}


def _raw(**data):
    return {"data": {"sources": ["unused"], "num_workers": 2, **data}, "precision": "fp32",
            "model": {"name": TINY, **LOCKED},
            "stages": [{"name": "s", "image_size": 32, "context_length": 16, "samples": 64, "global_batch": 16}]}


def test_recomputing_the_first_blocks_gives_the_same_gradients():
    grads = []
    for blocks in (None, 1):
        stage = resolve_stage(config_from_dict(_raw(), check_paths=False), 0)
        torch.manual_seed(0)
        model = replace(stage, checkpoint_blocks=blocks).build_model(read_files=False).train()
        assert model.visual.trunk.checkpoint_blocks == blocks
        images, tokens = torch.randn(4, 3, 32, 32), torch.randint(1, 100, (4, 16))
        image_f, text_f, scale = model(image=images, text=tokens)[:3]
        (scale * image_f @ text_f.t()).logsumexp(1).mean().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=1e-5, atol=1e-6)


def test_the_tune_recomputes_the_fewest_blocks_that_fit():
    stage = resolve_stage(config_from_dict(_raw(), check_paths=False), 0)
    m = measure_stage(stage)
    none = plan_stage(stage, m, 2 ** 40, 989.0, 0.4, tune=True)
    assert (none.checkpoint_blocks, none.accumulation_steps, none.repeated_flops_per_sample) == (0, 1, 0)
    every = plan_stage(replace(stage, checkpoint_blocks=stage.image_depth), m, 2 ** 40, 989.0, 0.4)
    # between the two, with the CUDA context
    memory = int(gpu_memory_for((none.peak_bytes_per_rank + every.peak_bytes_per_rank) / 2 + CUDA_CONTEXT_BYTES))
    tuned = plan_stage(stage, m, memory, 989.0, 0.4, tune=True)
    depth = stage.image_depth
    assert 0 < tuned.checkpoint_blocks < depth and tuned.accumulation_steps == 1
    assert tuned.peak_bytes_per_rank * (1 + STEP_MARGIN) <= fit_budget(memory)
    fewer = plan_stage(replace(stage, checkpoint_blocks=tuned.checkpoint_blocks - 1, micro_batch=16), m,
                       memory, 989.0, 0.4)
    # one block fewer does not fit
    assert fewer.micro_batch != 16 or fewer.peak_bytes_per_rank * (1 + STEP_MARGIN) > fit_budget(memory)
    assert tuned.repeated_flops_per_sample == pytest.approx(m.grad_forward_flops_per_sample * tuned.checkpoint_blocks
                                                            / depth)
    assert tuned.gpu_hours < every.gpu_hours


def test_a_tuned_config_is_written_and_plans_the_same(tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({**_raw(), "deepspeed": {"config": "zero.json"}}))
    (tmp_path / "zero.json").write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    out = tmp_path / "tuned" / "run.yaml"
    out.parent.mkdir()
    assert plan_main([str(config), "--gpus", "2", "--gpu-memory", GPU_27_MIB_FREE, "--tune", "--write-config",
                      str(out)]) == 0
    printed = capsys.readouterr().out
    assert "tuned: ZeRO-" in printed and "saves" in printed and f"wrote {out}" in printed
    cfg = load_run_config(out, check_paths=False)
    assert not cfg.model.grad_checkpointing and cfg.stages[0].checkpoint_blocks is not None
    assert plan_main([str(out), "--gpus", "2", "--gpu-memory", GPU_27_MIB_FREE, "--json"]) == 0
    again = json.loads(capsys.readouterr().out)[0]
    assert (again["micro_batch"], again["checkpoint_blocks"], again["zero_stage"]) == \
        (cfg.stages[0].micro_batch, cfg.stages[0].checkpoint_blocks, cfg.deepspeed.zero_stage)


def _plan_error(tmp_path, capsys, raw, *args):
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(raw))
    code = plan_main([str(config), "--gpus", "2", *args])
    err = capsys.readouterr().err.strip()
    return code, err


def test_a_node_without_the_host_memory_is_one_line_with_the_buffer_that_fits(tmp_path, capsys):
    # groups of 10 shards (100,000 DataComp samples): the 100,000 samples a stream fill the buffers
    code, err = _plan_error(tmp_path, capsys, _raw(host_shuffle_buffer=200_000, shards_per_group=10), "--gpu-memory",
                            "80GiB", "--no-memory", "--host-memory", "4GiB")
    assert code == 2 and len(err.splitlines()) == 1
    assert "stage s: host memory" in err and "exceeds --host-memory 4.00 GiB by" in err
    fits = int(err.split("data.host_shuffle_buffer: ")[1].split()[0].replace(",", ""))
    assert 0 < fits < 200_000
    code, _ = _plan_error(tmp_path, capsys, _raw(host_shuffle_buffer=fits, shards_per_group=10), "--gpu-memory",
                          "80GiB", "--no-memory", "--host-memory", "4GiB")
    assert code == 0   # the setting the line names fits


def test_a_stage_that_does_not_fit_the_gpu_is_one_line(tmp_path, capsys):
    code, err = _plan_error(tmp_path, capsys, _raw(), "--gpu-memory", "1MiB")
    assert code == 2 and len(err.splitlines()) == 1
    assert "stage s: does not fit 1.0 MiB a GPU" in err and "short" in err and "fix: " in err


def test_the_stream_and_the_planner_read_one_stream_setting(monkeypatch):
    data = {"host_shuffle_buffer": 64_000, "num_workers": 4}
    cfg = config_from_dict({**_raw(**data), "stages": [{**_raw()["stages"][0], "global_batch": 64}]},
                           check_paths=False)
    stage = resolve_stage(cfg, 0, world_size=8, ranks_per_host=4)
    assert stage.stream == stream_settings(cfg.data, 8, 8, None, 4)
    # 8 ranks x 4 workers = 32 streams, 4 ranks a host read 16 of them: 64,000 / 16 each
    assert (stage.stream.streams, stage.stream.per_host, stage.shuffle_buffer) == (32, 16, 4_000)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    first = config_from_dict({**_raw(**data), "stages": [{**_raw()["stages"][0], "global_batch": 64}]},
                             check_paths=False)
    settled = launch_stream_settings(first, 8)
    assert settled == stage.stream and (settled.streams, settled.shuffle_buffer) == (32, 4_000)
    assert (first.data.canonical_streams, first.data.shuffle_buffer) == (None, None)   # the validated config as read
    recorded = first.to_dict(settled)["data"]   # what run_config.yaml and every checkpoint record
    assert (recorded["canonical_streams"], recorded["shuffle_buffer"], recorded["host_shuffle_buffer"]) == (
        32, 4_000, 64_000)


def test_a_resume_on_another_process_count_keeps_the_recorded_buffer(tmp_path, monkeypatch):
    data = {"host_shuffle_buffer": 64_000, "num_workers": 4, "canonical_streams": 32}
    stages = [{**_raw()["stages"][0], "global_batch": 64}]
    tag = tmp_path / "step_1"
    tag.mkdir()
    recorded = {"data": {**data, "shuffle_buffer": 4_000}}
    (tag / "crate_clip.json").write_text(json.dumps({"run_config": recorded}))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")   # 2 ranks, one host: the share would be 64,000 / 32
    resumed = config_from_dict({**_raw(**data), "stages": stages}, check_paths=False)
    settled = launch_stream_settings(resumed, 2, tag)
    assert (settled.streams, settled.shuffle_buffer) == (32, 4_000)   # the first launch's: the same sample order
    fresh = config_from_dict({**_raw(**data), "stages": stages}, check_paths=False)
    assert launch_stream_settings(fresh, 2).shuffle_buffer == 2_000
    # the node now holds twice the host budget (32 streams of 4,000): the plan says so
    host = plan_stage(resolve_stage(resumed, 0, 2, ranks_per_host=2, stream=settled), measure_stage(
        resolve_stage(resumed, 0, 2, stream=settled), memory=False), 2 ** 40, None, 0.4).host_bytes
    sample = RAW_SAMPLE_BYTES + SAMPLE_OBJECT_BYTES   # a raw sample's members and its Python objects
    assert host["shuffle buffers"] == 32 * 4_000 * sample == 2 * 64_000 * sample


def test_the_host_plan_counts_the_batches_the_dataloader_keeps_in_flight_and_a_group_caps_a_buffer(
        tmp_path, fashion_mnist_dir):
    """The planner's loader terms against the real stream: a rank's DataLoader keeps prefetch_factor x K rank batches
    outstanding (K items a step; torch asks each worker for the loader's prefetch_factor, which the stream sets to
    data.prefetch_factor x K), planned as the K items being built plus the batches in flight; a stream's buffer
    holds at most its shard group's samples."""
    from data_fixtures import write_numbered_shards

    from crate_clip.data.train_stream import build_train_stream
    from crate_clip.train.planning.planner import host_bytes_per_node, input_sample_bytes

    write_numbered_shards(tmp_path, 48, 12, fashion_mnist_dir)
    raw = _raw(num_workers=2, prefetch_factor=3, shuffle_buffer=1_000, shards_per_group=2)
    raw["data"]["sources"] = [str(tmp_path)]
    cfg = config_from_dict({**raw, "stages": [{**raw["stages"][0], "global_batch": 8}]}, check_paths=False)
    stage = resolve_stage(cfg, 0, ranks_per_host=1)
    host = host_bytes_per_node(stage, raw_sample_bytes=1.0, samples_per_shard=12)
    assert host["shuffle buffers"] == 2 * 24 * (1.0 + SAMPLE_OBJECT_BYTES)   # 2 streams of 2 shards x 12, not 1,000
    in_flight = host["batches in flight"] / (8 * input_sample_bytes(stage, 1.0))   # rank batches
    stream = build_train_stream(cfg.data, image_size=32, context_length=16, text_mask="truncate", batch_size=8)
    loader = iter(stream._loader())
    item = next(loader)
    # items asked for and not yet given to the stream (some may have arrived early and wait in the trainer); every
    # item is one worker's half of a rank batch
    outstanding_samples = (loader._send_idx - loader._rcvd_idx) * 8 // 2
    del loader
    assert item[0].shape[0] == 4 and outstanding_samples == 3 * 2 * 8 == (in_flight + 1) * 8
    # a training launch passes the settings it settled (a resume: the checkpoint's buffer): the stream takes them
    settled = build_train_stream(cfg.data, image_size=32, context_length=16, text_mask="truncate", batch_size=8,
                                 settings=replace(stage.stream, shuffle_buffer=24))
    assert (settled.spec.shuffle_buffer, settled.canonical_streams, settled.settled_streams) == (24, 2, 2)


def test_micro_batch_auto_is_the_largest_that_fits_a_gpu():
    """resolve_stage on a GPU calls planner.fit_micro_batch for micro_batch: auto (it was once dropped while still
    called): the whole rank batch where it fits, less where it does not, and one line where nothing does."""
    from crate_clip.core.errors import ConfigError
    from crate_clip.train.planning.planner import CUDA_CONTEXT_BYTES, fit_micro_batch

    stage = resolve_stage(config_from_dict(_raw(), check_paths=False), 0)
    assert fit_micro_batch(stage, 2 ** 40) == 16
    one = plan_stage(stage, measure_stage(stage), 2 ** 40, None, 0.4)
    tight = int(gpu_memory_for(one.peak_bytes_per_rank - one.activation_bytes_per_sample * 8 + CUDA_CONTEXT_BYTES))
    assert fit_micro_batch(stage, tight) < 16
    with pytest.raises(ConfigError, match="micro_batch: auto"):
        fit_micro_batch(stage, CUDA_CONTEXT_BYTES)
