"""tools/uv_install.py, which `make install` runs uv through: pip's package sources, as this Python's real pip
reports them (`pip config list`), become uv's options (issue 42 item 9)."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _uv_install():
    spec = importlib.util.spec_from_file_location("uv_install", ROOT / "tools" / "uv_install.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_pips_sources_become_uvs_options(tmp_path, monkeypatch):
    """A pip.conf with a wheel folder, two extra indexes and a constraint file ([install] beats [global]), and
    PIP_FIND_LINKS in the environment (which beats both): uv gets each, with pip's rule among indexes."""
    conf = tmp_path / "pip.conf"
    conf.write_text("[global]\nfind-links = /from/file\nextra-index-url =\n    file:///one/simple\n"
                    "    file:///two/simple\nconstraint = /global/c.txt\ncert = /my/ca.pem\n"
                    "[install]\nconstraint = /install/c.txt\n")
    for key in [k for k in os.environ if k.startswith("PIP_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("PIP_CONFIG_FILE", str(conf))   # read last: its settings beat the machine's files
    monkeypatch.setenv("PIP_FIND_LINKS", "/from/env")
    uv = _uv_install()
    settings = uv.pip_settings(sys.executable)
    assert settings["find-links"] == "/from/env" and settings["constraint"] == "/install/c.txt", settings
    options, env = uv.uv_options(settings)
    pairs = list(zip(options[::2], options[1::2]))
    assert pairs[0] == ("--index-strategy", "unsafe-best-match")
    assert [v for k, v in pairs if k == "--extra-index-url"] == ["file:///one/simple", "file:///two/simple"]
    assert ("--find-links", "/from/env") in pairs and ("--constraint", "/install/c.txt") in pairs
    assert ("--find-links", "/from/file") not in pairs and env == {"SSL_CERT_FILE": "/my/ca.pem"}


def test_it_runs_the_uv_it_is_given_and_exits_with_its_code(tmp_path):
    """The command line uv receives (a stand-in program that records it and fails), and the exit code passed on."""
    fake = tmp_path / "uv"
    fake.write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path / 'args'}\nexit 3\n")
    fake.chmod(0o755)
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "uv_install.py"), str(fake), sys.executable, "-q",
                           "torch==2.14.1"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3, proc.stderr
    args = (tmp_path / "args").read_text().split()
    assert args[:4] == ["pip", "install", "--python", sys.executable] and args[-2:] == ["-q", "torch==2.14.1"]
    assert "--index-strategy" in args
