"""Issue 55 item 3: what a training rank imports at start. DeepSpeed's Muon module, which every engine imports, is
loaded with its torch.compile wrapping deferred to the first call (stage_setup/deepspeed_imports.py): no compiler
stack imported for kernels our runs never call, and the kernels still work when called."""
import sys

import warm_python
from train_fixtures import run_env

# Forked from the warm interpreter that imported what a rank imports first (torch, DeepSpeed, open_clip, whose
# torchvision imports torch._dynamo): what the plain import adds is inductor's compile_fx and functorch.compile
PROGRAM = r"""
import sys
import torch
import deepspeed
from deepspeed.runtime import compiler
from crate_clip.train.stage_setup.deepspeed_imports import MUON_MODULE, import_muon_lazily

before = compiler.compile
assert import_muon_lazily() is True
assert compiler.compile is before, "deepspeed.runtime.compiler.compile was not restored"
assert MUON_MODULE in sys.modules
print("COMPILER", "torch._inductor.compile_fx" in sys.modules, "functorch.compile" in sys.modules)
assert import_muon_lazily() is False   # imported already: nothing done twice

from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam   # what the engines import: no cost now
from deepspeed.runtime.zero.muon import original_muon
from deepspeed.runtime.zero.utils import is_zero_supported_optimizer, ZERO_SUPPORTED_OPTIMIZERS

# the deferred kernel runs: its first call compiles (here with dynamo switched off, so the compiled function is the
# eager one and the check costs no C++ build) and gives the plain function's result
import torch._dynamo
torch._dynamo.config.disable = True
ns = original_muon.zeropower_via_newtonschulz5
g = torch.randn(8, 12, generator=torch.Generator().manual_seed(0))
out = ns(g, 5)
ref = ns.__wrapped__(g, 5)
print("SAME", torch.equal(out, ref), "SHAPE", tuple(out.shape), "CLASS", MuonWithAuxAdam.__name__)
"""


def test_deepspeed_muon_module_loads_without_the_compiler_and_its_kernels_still_run():
    done = warm_python.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, env=run_env(),
                           timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines() if line.startswith(("COMPILER", "SAME")))
    # the plain import of the module imports inductor's compile_fx (torch.compile's default backend), functorch's
    # compile and ~560 other modules
    assert lines["COMPILER"] == "False False", done.stdout
    assert lines["SAME"] == "True SHAPE (8, 12) CLASS MuonWithAuxAdam", done.stdout
