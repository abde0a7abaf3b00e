"""Shared pytest set-up: offline hubs, NLTK test data, small thread counts for a 2-core machine."""
import os
from pathlib import Path

import pytest

pytest_plugins = ["cpu_cost"]   # each test's CPU time, its processes included: the 15 costliest after every run

# Nothing may be fetched from a model or data hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# What `import sklearn` (and joblib) put into os.environ, set from the start: otherwise the first test that imports
# them changes the environment of every later command of its pytest process, and tests/warm_python.py, which forks
# a command warm only in the environment its interpreter started with (KMP_* is read at load time), would start each
# of them as a fresh interpreter instead (~7 s of CPU each).
os.environ.setdefault("KMP_DUPLICATE_LIB_OK", "True")
os.environ.setdefault("KMP_INIT_AT_FORK", "FALSE")
# The same for `import deepspeed`, which sets this one (PYTORCH_* is read at load time): a test importing DeepSpeed in
# the pytest process would otherwise turn every later warm command of that process into a fresh interpreter.
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

REPO_ROOT = Path(__file__).resolve().parents[1]
# NLTK's English tagger for the tests only (see ../shared/nltk_data/README.md); never copied in.
SHARED_NLTK = REPO_ROOT.parent / "shared" / "nltk_data"
if SHARED_NLTK.is_dir():
    os.environ.setdefault("NLTK_DATA", str(SHARED_NLTK))

FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")

# Modules that share a session fixture costly to build, scheduled as one unit by `make test`'s `--dist loadscope`
# (one pytest-xdist worker each, so the fixture is built once, not once per worker): module -> the unit's first.
SAME_WORKER = {
    "tests/test_train_whitebox.py": "tests/test_train_text_tower.py",   # both_crate_run: a 2-rank ZeRO-3 run, ~20 s
    "tests/test_eval_retrieval.py": "tests/test_eval_zeroshot.py",      # vit: the tiny ViT CLIP trained once
    "tests/test_eval_clip_benchmark.py": "tests/test_eval_zeroshot.py",
}
_renamed = [m for pair in SAME_WORKER.items() for m in pair if not (REPO_ROOT / m).is_file()]
assert not _renamed, f"tests/conftest.py SAME_WORKER names modules that are gone: {_renamed}"


@pytest.hookimpl(optionalhook=True)   # a pytest-xdist hook: without the plugin (-p no:xdist), unused
def pytest_xdist_make_scheduler(config, log):
    """loadscope's scheduler with the SAME_WORKER modules in one work unit."""
    if config.getoption("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class SharedFixtureScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return SAME_WORKER.get(module, super()._split_scope(nodeid))

    return SharedFixtureScheduling(config, log)


@pytest.fixture(scope="session")
def fashion_mnist_dir():
    """The Debian Fashion-MNIST folder; skips the test where the package is not installed."""
    if not (FASHION_MNIST_DIR / "t10k-images-idx3-ubyte.gz").exists():
        pytest.skip("Debian package dataset-fashion-mnist is not installed")
    return FASHION_MNIST_DIR


@pytest.fixture(scope="session")
def sets(tmp_path_factory, fashion_mnist_dir) -> dict:
    """The Fashion-MNIST evaluation sets (folder, flat folder, shards, captioned shards), built once per session."""
    from eval_fixtures import write_eval_sets
    return write_eval_sets(tmp_path_factory.mktemp("eval_sets"), fashion_mnist_dir)


@pytest.fixture(scope="session")
def vit(tmp_path_factory, fashion_mnist_dir):
    """(model, open_clip name) of the tiny ViT CLIP trained once per session on Fashion-MNIST."""
    from eval_fixtures import train_tiny_vit
    return train_tiny_vit(tmp_path_factory.mktemp("evaltest_config"), fashion_mnist_dir)


@pytest.fixture
def vit_file(vit, tmp_path):
    """(open_clip name, weights file) of the shared tiny ViT CLIP, saved as safetensors for the CLIs."""
    from safetensors.torch import save_file
    model, name = vit
    path = tmp_path / "vit.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, path)
    return name, path


@pytest.fixture(scope="session")
def tiny_fmnist(tmp_path_factory, fashion_mnist_dir):
    """train_fixtures.write_tiny_fmnist, once per session (every training module reads it; a test that damages its
    evaluation set works on its own copy)."""
    from train_fixtures import write_tiny_fmnist
    return write_tiny_fmnist(tmp_path_factory.mktemp("fmnist"), fashion_mnist_dir)


@pytest.fixture(scope="session")
def both_crate_run(tmp_path_factory, tiny_fmnist):
    """(run folder, config file, data folder) of the tiny both-CRATE CLIP's 2-process ZeRO-3 run, trained once per
    session for the text-tower and white-box tests (train_fixtures.both_crate_config)."""
    from train_fixtures import train_both_crate
    root = tmp_path_factory.mktemp("both_crate")
    return (*train_both_crate(root, tiny_fmnist), tiny_fmnist)
