"""Tests only (tests/warm_python.py, "a stand-in for a trainer"): put first on PYTHONPATH by a test, with
WARM_PYTHON_STAND_IN naming the suite's warm interpreter, it turns a fresh `python -m crate_clip.train.cli ...` started
by a real launcher (torchrun, srun, deepspeed's runner, on a node of tests/two_nodes.py) into a stand-in for the same
command forked from the warm interpreter, before this interpreter imports anything costly. Any other command runs as
it is."""
import os
import sys

if os.environ.get("WARM_PYTHON_STAND_IN"):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # tests/
    import warm_python

    _argv = warm_python.training_entry(sys.orig_argv)
    if _argv is not None:
        warm_python.stand_in(_argv)
