"""The built wheel installs only the project's own import name (issue 28): every top-level entry of the wheel is
crate_clip (the repository's eval/ and data_pipelines/ go in as crate_clip.eval and crate_clip.data), and the build
prints no setuptools warning (a data folder taken for a package, a package_data pattern that matches nothing)."""
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# what the build must not see: environments, earlier builds, run and benchmark outputs (gigabytes: they would only
# slow the copy, fill the disk, or leave stale files in build/). In a git checkout only the files git would commit
# are copied; elsewhere these names are left out.
TOP_LEVEL_SKIP = {".git", "build", "dist", "runs", "data", ".pytest_cache", ".whl"}


def _not_source(folder, names):
    top = TOP_LEVEL_SKIP if Path(folder) == ROOT else set()
    out = Path(folder) == ROOT / "bench"
    return [n for n in names if n in top or n.startswith(".venv") or (out and n == "out") or n == "__pycache__"
            or n.endswith(".egg-info")]


def _copy_source(dest: Path) -> None:
    """The repository's own files into `dest`: tracked or untracked-but-not-ignored, as git lists them."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True)
    if listed.returncode != 0:   # not a git checkout (an unpacked sdist): the names above left out
        shutil.copytree(ROOT, dest, ignore=_not_source)
        return
    for name in listed.stdout.decode().split("\0"):
        path = ROOT / name
        if name and path.is_file():   # a tracked file deleted in the working tree is not there
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, dest / name)

# setuptools' warnings are classes named ...Warning (BuildBackendWarning, SetuptoolsDeprecationWarning), the older
# distutils ones lines starting with "warning:"
WARNING = re.compile(r"warning\b", re.IGNORECASE)


@pytest.fixture(scope="module")
def built_wheel(tmp_path_factory):
    """(wheel path, build log): `pip wheel` of a copy of the source tree, offline and without build isolation
    (the build backend is the one installed here)."""
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "src"
    _copy_source(source)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}   # else distutils warns
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "--no-build-isolation",
                           "--no-index", "-w", str(tmp / "out"), str(source)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    wheels = list((tmp / "out").glob("crate_clip-*.whl"))
    assert len(wheels) == 1
    return wheels[0], proc.stdout + proc.stderr


def test_wheel_has_only_crate_clip_at_top_level(built_wheel):
    wheel, _ = built_wheel
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        top = {n.split("/", 1)[0] for n in names}
        dist_info = [t for t in top if t.endswith(".dist-info")]
        assert len(dist_info) == 1
        assert top - set(dist_info) == {"crate_clip"}
        declared = zf.read(f"{dist_info[0]}/top_level.txt").decode().split()
    assert declared == ["crate_clip"]
    # the mapped folders and the model configs (package data) are in, under the one name
    for must in ("crate_clip/eval/tasks/zeroshot.py", "crate_clip/data/train_stream.py", "crate_clip/core/errors.py"):
        assert must in names
    assert any(n.startswith("crate_clip/models/model_configs/") and n.endswith(".json") for n in names)
    # configs/ as crate_clip/configs, every file of it: the demo's config (crate_clip/train/demo.py finds it there),
    # the DataComp configs beside the DeepSpeed files they name (../deepspeed/zero1.json), the Slurm script
    shipped = sorted(n[len("crate_clip/"):] for n in names if n.startswith("crate_clip/configs/"))
    assert shipped == sorted(str(p.relative_to(ROOT)) for p in (ROOT / "configs").rglob("*") if p.is_file())


def test_wheel_build_prints_no_warning(built_wheel):
    _, log = built_wheel
    assert [line for line in log.splitlines() if WARNING.search(line)] == []


def test_warning_pattern_sees_setuptools_warnings():
    """The check above can fail: the lines setuptools printed for the data folder taken for a package match."""
    assert WARNING.search("build_py.py:215: BuildBackendWarning: Package 'crate_clip.models.model_configs' is absent")
    assert WARNING.search("  warning: no files found matching 'eval/classnames/*.txt'")
    assert not WARNING.search("copying crate_clip/eval/tasks/zeroshot.py -> build/lib/crate_clip/eval")
