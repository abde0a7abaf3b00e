"""Throughput accounting: counted model FLOPs, data wait vs step time, the warning, the GPU peak table."""
import time

from crate_clip.train.stage_setup.engine import DistInfo
from crate_clip.train.run.run_config import config_from_dict
from crate_clip.train.stage_setup.stage_model import resolve_stage


def _cfg(mask="random"):
    return config_from_dict({
        "data": {"sources": ["unused"]}, "model": {"name": "CRATE-alpha-CLIPA-tiny"},
        "stages": [{"name": "s", "image_size": 32, "context_length": 16, "samples": 64, "global_batch": 32,
                    "lr": 1e-3, "image_mask": mask, "image_mask_ratio": 0.5}]}, check_paths=False)


def test_step_meter_fields_and_data_wait_warning():
    from crate_clip.train.reporting.throughput import StepMeter

    cfg = _cfg()
    meter = StepMeter(resolve_stage(cfg, 0), DistInfo(0, 1, 0, "cpu"))
    assert meter.counts.flops > 1e6
    assert meter.counts.tokens == 1 + 32 + 16  # class + half of the 8x8 patches (patch 4) + text
    for _ in range(3):
        meter.begin()
        time.sleep(0.02)  # the loader
        meter.data_ready()
        time.sleep(0.01)  # the step
        meter.step_done()
    f = meter.record()
    assert 0.5 < f.data_wait_frac < 0.9 and f.data_wait_s >= 0.02
    assert f.samples_per_s_window > 0 and f.tokens_per_s == f.samples_per_s_window * 49
    assert f.tflops > 0 and f.mfu is None  # CPU: no peak to compare with
    assert f.peak_memory_gib_max_rank > 0
    assert "data loader held up" in meter.data_wait_warning(f)
    meter.begin()
    meter.data_ready()
    time.sleep(0.02)
    meter.step_done()
    assert meter.data_wait_warning(meter.record()) is None


def test_masking_halves_the_image_flops():
    full, half = resolve_stage(_cfg("none"), 0).counts, resolve_stage(_cfg("random"), 0).counts
    assert half.flops < 0.8 * full.flops and half.forward_flops < half.flops


def test_gpu_peak_table():
    from crate_clip.train.planning.planner import gpu_peak_tflops, parse_bytes

    assert gpu_peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert gpu_peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert gpu_peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert gpu_peak_tflops("some cpu") is None
    assert parse_bytes("80GiB") == 80 * 2 ** 30 and parse_bytes("512MiB") == 2 ** 29


def test_the_loader_warning_comes_once_per_stage_with_advice_that_applies():
    from crate_clip.train.reporting.throughput import StepMeter, loader_advice

    assert loader_advice(1, 1, 8, "cpu", "cpu").startswith("raise data.num_workers")
    assert loader_advice(6, 1, 8, "cpu", "cuda:0").startswith("raise data.num_workers")   # one core left for it
    for workers, ranks, cores in ((7, 1, 8), (1, 2, 2), (1, 1, 2), (3, 8, 32)):   # no core free for a worker
        advice = loader_advice(workers, ranks, cores, "cpu", "cpu")
        assert "raise" not in advice and f"every CPU core is busy ({cores} cores" in advice
    assert "data.decode: device" in loader_advice(3, 8, 32, "cpu", "cuda:0")
    assert "data.decode" not in loader_advice(3, 8, 32, "device", "cuda:0")

    stage = resolve_stage(_cfg(), 0)
    for _ in range(2):   # two stages: each warns once
        meter = StepMeter(stage, DistInfo(0, 1, 0, "cpu"), loader_workers=1)
        warnings = []
        for _ in range(3):   # three logged windows, each held up by the loader
            meter.begin()
            time.sleep(0.02)
            meter.data_ready()
            meter.step_done()
            warnings.append(meter.data_wait_warning(meter.record()))
        assert warnings[0].startswith("[warn] the data loader held up") and warnings[1:] == [None, None]
        assert meter.advice in warnings[0]
