"""Throughput accounting: counted model FLOPs, data wait vs step time, the warning, the GPU peak table."""
import time

from crate_clip.train.engine import DistInfo
from crate_clip.train.run_config import config_from_dict


def _cfg(mask="random"):
    return config_from_dict({
        "data": {"sources": ["unused"]}, "model": {"name": "CRATE-alpha-CLIPA-tiny"},
        "stages": [{"name": "s", "image_size": 32, "context_length": 16, "samples": 64, "global_batch": 32,
                    "lr": 1e-3, "image_mask": mask, "image_mask_ratio": 0.5}]}, check_paths=False)


def test_step_meter_fields_and_data_wait_warning():
    from crate_clip.train.throughput import StepMeter

    cfg = _cfg()
    meter = StepMeter(cfg, cfg.stages[0], DistInfo(0, 1, 0, "cpu"))
    assert meter.flops_per_sample > 1e6
    assert meter.tokens == 1 + 32 + 16  # class + half of the 8x8 patches (patch 4) + text
    for _ in range(3):
        meter.begin()
        time.sleep(0.02)  # the loader
        meter.data_ready()
        time.sleep(0.01)  # the step
        meter.step_done()
    f = meter.fields()
    assert 0.5 < f["data_wait_frac"] < 0.9 and f["data_wait_s"] >= 0.02
    assert f["samples_per_s_window"] > 0 and f["tokens_per_s"] == f["samples_per_s_window"] * 49
    assert f["tflops"] > 0 and f["mfu"] is None  # CPU: no peak to compare with
    assert f["peak_memory_gib_max_rank"] > 0
    assert "data loader held up" in meter.data_wait_warning(f)
    meter.begin()
    meter.data_ready()
    time.sleep(0.02)
    meter.step_done()
    assert meter.data_wait_warning(meter.fields()) is None


def test_masking_halves_the_image_flops():
    from crate_clip.train.planner import count_flops_per_sample

    cfg_full, cfg_half = _cfg("none"), _cfg("random")
    full, half = count_flops_per_sample(cfg_full, cfg_full.stages[0]), count_flops_per_sample(cfg_half, cfg_half.stages[0])
    assert half[0] < 0.8 * full[0] and half[1] < half[0]


def test_gpu_peak_table():
    from crate_clip.train.planner import gpu_peak_tflops, parse_bytes

    assert gpu_peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert gpu_peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert gpu_peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert gpu_peak_tflops("some cpu") is None
    assert parse_bytes("80GiB") == 80 * 2 ** 30 and parse_bytes("512MiB") == 2 ** 29
