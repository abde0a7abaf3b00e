"""What a user gives the planner on the command line: the known GPUs (bf16 peak, memory), the default MFU,
byte sizes such as 80GiB. No torch here, so that `crate-clip plan --help` builds its parser at once."""
import math

# dense bf16 tensor-core peak (TFLOP/s, no sparsity) and memory (GiB) of known GPUs
GPU_TABLE = {
    "h100": (989.0, 80), "h100-pcie": (756.0, 80), "h200": (989.0, 141), "b200": (2250.0, 180),
    "a100": (312.0, 80), "a100-40gb": (312.0, 40), "l40s": (362.0, 48), "a10g": (70.0, 24),
    "l4": (121.0, 24), "v100": (125.0, 32),  # v100: fp16 (no bf16)
}
DEFAULT_MFU = 0.40


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
