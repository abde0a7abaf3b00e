"""What a user gives the planner on the command line: the known GPUs (bf16 peak, memory), the efficiency assumed
for time (Efficiency: HFU or MFU), byte sizes such as 80GiB. No torch here, so that `crate-clip plan --help` builds
its parser at once."""
import math
from dataclasses import dataclass

# dense bf16 tensor-core peak (TFLOP/s, no sparsity) and memory (GiB) of known GPUs
GPU_TABLE = {
    "h100": (989.0, 80), "h100-pcie": (756.0, 80), "h200": (989.0, 141), "b200": (2250.0, 180),
    "a100": (312.0, 80), "a100-40gb": (312.0, 40), "l40s": (362.0, 48), "a10g": (70.0, 24),
    "l4": (121.0, 24), "v100": (125.0, 32),  # v100: fp16 (no bf16)
}
# The default assumption is on executed FLOPs (HFU): the GPU runs a recomputed forward as fast as any other, so a
# plan that recomputes more takes longer (what --tune weighs). 0.40 is what `--mfu` meant until issue 53, where the
# planner timed the executed FLOPs (recomputation included) at it: the same times, now named for what they assume.
DEFAULT_HFU = 0.40
HFU_WORDS = "executed FLOPs, recomputation included"
MFU_WORDS = "model FLOPs, as the training meter counts them"
# model.compile: true compiles both towers before each stage's first step (each stage builds a new model, which
# compiles afresh). Measured on the CPU only (bench/bench_compile.py, BENCHMARKS.md "Issue 55: torch.compile of both
# towers on the CPU", an idle 2-core Xeon), with an empty inductor cache: 37-49 s a stage at the demo's shapes, 49-53
# s for the B/16 image tower; 2-3 s with the cache a previous run left. A GPU's compile is not measured: the plan adds
# about the largest measured to each compiled stage's time, as a stated assumption.
COMPILE_S_PER_STAGE = 55.0
COMPILE_WORDS = ("on the CPU compiled steps were 1.03-1.13x faster than eager, for 37-53 s of compiling a stage "
                 "(bench/bench_compile.py)")


@dataclass(frozen=True)
class Efficiency:
    """The fraction of the GPUs' bf16 peak a plan's time assumes, on one of two FLOP counts:
    - "hfu" (hardware FLOPs utilisation): executed FLOPs, i.e. the model FLOPs (forward + backward, what the
      training meter and bench/bench_gpu.py count) plus the forward that runs again (checkpoint recompute, the
      accumulation's grad pass);
    - "mfu" (model FLOPs utilisation): the model FLOPs alone, the `mfu` that metrics.jsonl logs and
      bench/bench_gpu.py measures; time = model FLOPs / (GPUs x peak x MFU), and the recomputation shows as the
      HFU that time needs (MFU x executed / model).
    Either way the other one is derived, never assumed, and no figure counting recomputed FLOPs is called MFU."""
    kind: str      # "hfu" or "mfu": which one is assumed
    value: float

    def on_executed(self, model_flops: float, executed_flops: float) -> float:
        """The HFU this assumption gives for work of `model_flops` that executes `executed_flops`."""
        return self.value if self.kind == "hfu" else self.value * executed_flops / model_flops

    def on_model(self, model_flops: float, executed_flops: float) -> float:
        """The MFU this assumption gives for that work."""
        return self.value if self.kind == "mfu" else self.value * model_flops / executed_flops


DEFAULT_EFFICIENCY = Efficiency("hfu", DEFAULT_HFU)


BYTE_SUFFIXES = (("tib", 2 ** 40), ("tb", 2 ** 40), ("t", 2 ** 40), ("gib", 2 ** 30), ("gb", 2 ** 30),
                 ("g", 2 ** 30), ("mib", 2 ** 20), ("mb", 2 ** 20), ("m", 2 ** 20), ("kib", 2 ** 10),
                 ("kb", 2 ** 10), ("k", 2 ** 10), ("b", 1))


def parse_bytes(text: str) -> int:
    """'80GiB', '80GB', '141G', '512KiB', '12345' -> bytes (binary units: GPUs are sold in GiB); ValueError
    naming the accepted forms otherwise."""
    t = str(text).strip().lower().replace(" ", "")
    number, mult = t, 1
    for suffix, size in BYTE_SUFFIXES:
        if t.endswith(suffix):
            number, mult = t[: -len(suffix)], size
            break
    try:
        value = float(number)
    except ValueError:
        raise ValueError(f"{text!r} is not a size: a number with an optional unit, e.g. 80GiB, 141G, 512MiB, "
                         f"64KiB or 12345 (bytes)") from None
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{text!r}: a size must be a finite number >= 0")
    return int(value * mult)
