# The README's commands. `make demo` runs the main job on its embedded default (Fashion-MNIST),
# `make test` runs the test suite. Both create the virtual environment and install what they need.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# On a machine with no torch, pin the release this project is tested with (on the dev machines these
# wheels lie on disk, CPU-runnable); a torch already installed in $(PYTHON) is respected instead.
TORCH_PIN ?= torch==2.14.1 torchvision==0.29.1
# The installer: uv (PyPI's fast installer: BENCHMARKS.md, "make install") when it is on PATH, else installed into
# the venv from PyPI first; pip when neither works, when uv fails, or with INSTALLER=pip. uv reads no pip
# configuration, so tools/uv_install.py hands it pip's package sources (where the pinned torch wheels lie).
INSTALLER ?= uv
# Every process compiles the modules it imports unless their bytecode is on disk, and where PYTHONDONTWRITEBYTECODE
# is set (or the venv is read-only) it never is: `import timm` then costs 9.6 s of CPU instead of 4.6 s, and the
# suite starts many fresh interpreters. So the install compiles it: uv's --compile-bytecode for what it installs (pip
# compiles by default), compileall for the project's own packages (BENCHMARKS.md, "Bytecode at install").
PACKAGES := crate_clip data_pipelines eval
# Debian packages holding the real local data sets used by the demo and the tests (one list, in Python).
DEB_DATA := $(shell $(PYTHON) data_pipelines/sources/debian_packages.py)
# Debian packages of the real components some tests run: Slurm (tests/slurm_cluster.py), and for two nodes on one
# machine (tests/two_nodes.py) network namespaces, and ssh and pdsh for DeepSpeed's hostfile launch.
DEB_TOOLS := slurm-wlm iproute2 openssh-server openssh-client pdsh

.PHONY: install system-data demo test bench clip-benchmark timm-model-tests clean

install: $(VENV)/.installed

# The pin is decided by what the new venv sees: a venv made from another venv's python is a venv of its base
# interpreter, which does not see that venv's torch (without the pin, an unpinned torch pulls GBs of CUDA wheels).
$(VENV)/.installed: setup.cfg pyproject.toml
	@if $(PYTHON) -c "import torch" 2>/dev/null; then \
	    $(PYTHON) -m venv --system-site-packages $(VENV); \
	else \
	    $(PYTHON) -m venv $(VENV); \
	fi; \
	if $(PY) -c "import torch" 2>/dev/null; then \
	    echo "using the torch already installed in $(PYTHON)"; pin=""; \
	else \
	    pin="$(TORCH_PIN)"; \
	    if $(PYTHON) -c "import torch" 2>/dev/null; then \
	        echo "the torch of $(PYTHON) (a virtual environment) is not visible from $(VENV): installing $(TORCH_PIN)"; \
	    fi; \
	fi; \
	uv=""; if [ "$(INSTALLER)" = uv ]; then \
	    uv=$$(command -v uv || { $(PY) -m pip install -q uv >/dev/null 2>&1 && echo $(VENV)/bin/uv; }); \
	fi; \
	if [ -n "$$uv" ] && $(PY) tools/uv_install.py $$uv $(PY) -q --compile-bytecode --upgrade-package pip pip $$pin \
	        -e '.[dev]'; then \
	    echo "installed with $$uv"; \
	else \
	    if [ -n "$$uv" ]; then echo "uv failed (above); installing with pip"; fi; \
	    $(PY) -m pip install -q --upgrade pip && \
	    $(PY) -m pip install -q $$pin -e '.[dev]'; \
	fi
	@$(PY) -m compileall -q $(PACKAGES) >/dev/null || true
	@touch $@

# Installs the Debian data and test-tool packages when missing (needs root and apt); otherwise says what to install.
system-data:
	@missing=""; for p in $(DEB_DATA) $(DEB_TOOLS); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	    if command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
	        echo "installing Debian data packages:$$missing"; \
	        (export DEBIAN_FRONTEND=noninteractive; apt-get install -y -qq $$missing || \
	         (apt-get update -qq && apt-get install -y -qq $$missing)) >/dev/null; \
	    else \
	        echo "note: Debian packages missing:$$missing (install them with: sudo apt-get install$$missing);" \
	             "the demo needs $(firstword $(DEB_DATA)), some tests skip without the others"; \
	    fi; \
	fi

demo: install system-data
	$(PY) -m crate_clip.train.demo

# two pytest workers, a test module each (its module fixtures once): the 2-core machine's launched jobs leave a core
# idle most of the time in one process (120% CPU); `pytest tests/...` alone still runs in one
test: install system-data
	$(PY) -m pytest -q -n 2 --dist loadscope --durations=15 tests

bench: install system-data
	for b in bench/bench_*.py; do $(PY) $$b || exit 1; done

# CLIP_benchmark in a venv of its own (docs/export.md#clip_benchmark): its numpy < 2.4 bound stays out of .venv.
CB_VENV ?= .venv-clip-benchmark
clip-benchmark: $(CB_VENV)/.installed

$(CB_VENV)/.installed: setup.cfg pyproject.toml
	$(PYTHON) -m venv $(CB_VENV)
	$(CB_VENV)/bin/python -m pip install -q --upgrade pip
	$(CB_VENV)/bin/python -m pip install -q $(TORCH_PIN) '.[clip-benchmark]'
	@touch $@

# timm's own tests/test_models.py (from the sdist of the installed timm, on PyPI) on every registered CRATE tower.
# One line is added: 'crate_*' joins NON_STD_FILTERS, the list timm keeps for its own transformers with token
# outputs (vit_*, deit*, eva_*, ...), whose feature maps are not the NCHW grid the standard checks expect.
# TIMM_K selects the models (all 200 tests of the CRATE names: about 10 min on 2 cores; TIMM_K='crate and not huge').
TIMM_TESTS ?= build/timm-tests
TIMM_K ?= crate
timm-model-tests: install
	rm -rf $(TIMM_TESTS) && mkdir -p $(TIMM_TESTS)
	$(PY) -m pip download -q --no-deps --no-binary :all: -d $(TIMM_TESTS) \
	    "timm==$$($(PY) -c 'import timm; print(timm.__version__)')"
	tar xzf $(TIMM_TESTS)/timm-*.tar.gz -C $(TIMM_TESTS) --strip-components=2 --wildcards \
	    'timm-*/tests/test_models.py' 'timm-*/tests/conftest.py'
	sed -i "s/^NON_STD_FILTERS = \[/NON_STD_FILTERS = [\n    'crate_*',  # crate-clip's towers: transformers, as vit_*/" \
	    $(TIMM_TESTS)/test_models.py
	printf '\nimport crate_clip  # registers the CRATE towers with timm\n' >> $(TIMM_TESTS)/conftest.py
	# timm's settings, not this project's strict markers; timm's tests carry marks (base, cfg, ...) that nothing
	# registers here, and their ~77 unknown-mark warnings say nothing about the models
	printf '[pytest]\nfilterwarnings =\n    ignore::pytest.PytestUnknownMarkWarning\n' > $(TIMM_TESTS)/pytest.ini
	cd $(TIMM_TESTS) && $(abspath $(PY)) -m pytest -q -p no:cacheprovider test_models.py -k "$(TIMM_K)"

clean:
	rm -rf $(VENV) runs bench/out
