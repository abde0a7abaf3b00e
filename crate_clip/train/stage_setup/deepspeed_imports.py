"""DeepSpeed modules that every engine imports, made cheap where their import-time work buys a run nothing.

DeepSpeed imports its Muon optimizer in every engine (ZeRO's optimizer check, the ZeRO 1-2 gradient reduction, the
ZeRO-3 and bf16 optimizers), and that module wraps three functions in torch.compile as it loads: the wrapping imports
torch's compiler stack, 1.2-1.35 s of CPU in a rank that has imported the rest of its stack (2.7-2.9 s alone;
BENCHMARKS.md, "Issue 55: launch, step and exit beside open_clip_train"), at every launch. Our runs step a torch
AdamW, so the Muon functions are never called. The import cannot simply be refused: DeepSpeed imports the module
without a fallback on every ZeRO >= 1 step. So it is imported once, first, with the wrapping deferred to the first
call, which is when torch.compile compiles anyway.
"""
from __future__ import annotations

import functools
import importlib
import sys

MUON_MODULE = "deepspeed.runtime.zero.muon.muon_optimizer"


def _compile_on_first_call():
    """What deepspeed.runtime.compiler.compile() returns, deferred: a decorator that calls torch.compile on the
    function the first time the function is called, and the compiled function from then on."""
    def decorate(fn):
        compiled = []

        @functools.wraps(fn)
        def call(*args, **kwargs):
            if not compiled:
                import torch
                compiled.append(torch.compile(fn))
            return compiled[0](*args, **kwargs)
        return call
    return decorate


def import_muon_lazily() -> bool:
    """Import DeepSpeed's Muon module with its torch.compile wrapping deferred; False where it was imported already
    (its cost paid) or this DeepSpeed has none."""
    if MUON_MODULE in sys.modules:
        return False
    from deepspeed.runtime import compiler

    original = compiler.compile
    compiler.compile = _compile_on_first_call   # read by the module's decorators as it loads
    try:
        importlib.import_module(MUON_MODULE)
    except ImportError:   # a DeepSpeed without Muon: nothing imports it either
        return False
    finally:
        compiler.compile = original
    return True
