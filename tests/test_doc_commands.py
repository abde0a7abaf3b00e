"""Every shell command README.md and docs/ show (tests/doc_commands.py finds them) is accounted for: run here as
written (RUN_HERE: the data it names replaced by the visible STAND_INS, in a folder laid out like the repository
root), run by a test of its own (COVERED_BY, the test must exist) or said to need what this machine lacks
(NOT_HERE, with the reason). A command added to a page in none of them fails here, and so does an entry no page
shows any more. Whatever they name is checked against the code too: every `crate-clip` sub-command and option
(in launcher lines as well) against the command's --help, every `make` target against the Makefile, every
`configs/` and `bench/` path and `python -m` module against the checkout. And no documented command leaves an
untracked file in the checkout: what the commands run here write, and every output path a page names, is ignored
by .gitignore."""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import io
import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from doc_commands import (COVERED_BY, ENTRY_POINTS, FENCE, NOT_HERE, OTHER_TOOLS, PLACEHOLDER, ROOT, RUN_HERE,
                          STAND_INS, argv, commands, invocations)

TABLES = {"RUN_HERE": RUN_HERE, "COVERED_BY": COVERED_BY, "NOT_HERE": NOT_HERE, "ENTRY_POINTS": ENTRY_POINTS}
# a launcher line's module -> the `crate-clip` words it stands for
MODULES = {"crate_clip.cli": [], "crate_clip.train.cli": ["train"], "crate_clip.train.demo": ["demo"]}
NESTED = {"eval", "shards", "inspect", "convert"}
OUTPUT_OPTIONS = ("--out", "--output", "--run-dir", "--per-image-out", "--write-config", "--data-dir")


def _where(cmd) -> str:
    return f"{cmd.page}:{cmd.line}: {cmd.text}"


def _uncovered(found: list) -> list[str]:
    """The commands of `found` in none of the tables."""
    return [_where(c) for c in found if not any(c.text in table for table in TABLES.values())]


def test_every_command_is_run_covered_or_said_to_need_what_is_missing():
    found = invocations()
    twice = {t for t in set().union(*TABLES.values()) if sum(t in table for table in TABLES.values()) > 1}
    assert not twice, f"in more than one table: {twice}"
    missing = _uncovered(found)
    assert not missing, ("commands no test runs: add each to RUN_HERE, COVERED_BY or NOT_HERE in "
                         "tests/doc_commands.py:\n" + "\n".join(missing))
    shown = {c.text for c in found}
    gone = [f"{name}: {text}" for name, table in TABLES.items() for text in table if text not in shown]
    assert not gone, "entries no page shows any more (remove them):\n" + "\n".join(gone)


def test_the_covering_tests_exist():
    """Each COVERED_BY (and dry-run) test id names a test function of that file."""
    ids = set(COVERED_BY.values()) | {run.dry for run in RUN_HERE.values() if run.dry}
    absent = [i for i in sorted(ids) if not re.search(rf"^(async )?def {re.escape(i.split('::')[1])}\(",
                                                      (ROOT / i.split("::")[0]).read_text(), re.M)]
    assert not absent, f"no such test: {absent}"


def test_the_finder_reads_blocks_outputs_scripts_and_inline_commands(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("Run `make demo`, or see `crate-clip plan` and `crate-clip train --validate`.\n\n"
                    "```bash\ncrate-clip export runs/x \\\n    --out exports/y   # a comment\n# only a comment\n```\n\n"
                    "```\n$ crate-clip trian\ncrate-clip: unknown command\n```\n\n"
                    "```bash\n#!/bin/bash\n#SBATCH --nodes=1\nsrun x\n"
                    "srun -m crate_clip.cli train C.yaml \\\n  --resume auto\n```\n")
    found = [(c.kind, c.text) for c in commands([page])]
    assert found == [("block", "crate-clip export runs/x --out exports/y"), ("output", "crate-clip trian"),
                     ("script", "srun x"), ("script line", "srun -m crate_clip.cli train C.yaml --resume auto"),
                     ("inline", "make demo"), ("inline", "crate-clip plan"),
                     ("inline", "crate-clip train --validate")]
    assert [c.text for c in invocations([page])] == ["crate-clip export runs/x --out exports/y", "crate-clip trian",
                                                     "srun x", "make demo"]


# ------------------------------------------------------------------------------- what the commands name exists
def _crate_clip_words(words: list[str]) -> list[str] | None:
    """The `crate-clip` arguments a command line gives (directly, through python -m or a launcher), else None."""
    if words and words[0] == "crate-clip":
        return words[1:]
    for flag in ("-m", "--module"):
        if flag in words and words.index(flag) + 1 < len(words):
            module = words[words.index(flag) + 1]
            if module in MODULES:
                return MODULES[module] + words[words.index(flag) + 2:]
    return None


@functools.cache
def _help(path: tuple) -> str:
    """`crate-clip PATH --help`, run in this process."""
    from crate_clip.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        try:
            main([*path, "--help"])
        except SystemExit:
            pass
    return out.getvalue()


def _choices(group_help: str) -> list[str]:
    """The sub-commands a group's --help lists (`{zeroshot,retrieval,linear-probe}`, or its `maps`/`text` lines)."""
    braces = re.search(r"\{([\w,-]+)\}", group_help)
    return braces.group(1).split(",") if braces else re.findall(r"crate-clip \w+ (\w+) ", group_help)


def _subcommand(args: list[str]) -> tuple:
    depth = 2 if args and args[0] in NESTED and len(args) > 1 and not args[1].startswith("-") else 1
    return tuple(args[:depth])


def _shell_words(text: str) -> list[str]:
    try:
        return argv(text.replace("[", " ").replace("]", " "))
    except ValueError:   # an unbalanced quote in a prose mention
        return text.split()


def _option_problems(cmds: list) -> list[str]:
    """Each `crate-clip` sub-command or option of `cmds` (launcher lines too) that the command's --help lacks."""
    wrong = []
    for cmd in cmds:
        args = _crate_clip_words(_shell_words(cmd.text))
        if not args or cmd.kind == "output" or "|" in cmd.text or "/" in args[0] or args[0].endswith(":"):
            continue   # none; a deliberate mistake shown with its output; `eval/inspect/segment`; a printed line
        path = _subcommand([a for a in args if a != "..." and not PLACEHOLDER.match(a)])
        if not path or path[0].startswith("-") or path[-1].endswith(":"):
            continue   # `crate-clip --debug ...`; `crate-clip eval zeroshot: ...`, a line the command prints
        text = _help(path)
        if not text.lower().startswith("usage"):
            wrong.append(f"{_where(cmd)}: no command `crate-clip {' '.join(path)}`")
            continue
        if path[0] in NESTED and len(path) == 1:   # `crate-clip eval --model ...`: an option of one of its commands
            text += "".join(_help((path[0], sub)) for sub in _choices(text))
        for word in args[len(path):]:
            option = word.split("=")[0]
            if option.startswith("--") and not re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", text):
                wrong.append(f"{_where(cmd)}: `crate-clip {' '.join(path)}` has no option {option}")
    return wrong


def test_every_documented_subcommand_and_option_exists():
    """Mentions too (`crate-clip plan --tune`): a renamed or removed option fails here, not in a reader's shell.
    Old names are hidden from --help, so a page that still uses one fails as well. The pages' deliberate
    mistakes (docs/cli.md's `$ ` lines) are run and compared below instead."""
    wrong = _option_problems(commands())
    assert not wrong, "\n".join(wrong)


def test_a_new_command_without_a_test_and_a_stale_option_are_found(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("```bash\ncrate-clip shards folder pics --out data/new_shards\n"
                    "deepspeed --module crate_clip.train.cli --config C.yaml --resum auto\n```\n"
                    "See `crate-clip export --stagee 0`, `crate-clip eval zeroshot --workers 2` and "
                    "`crate-clip plann`.\n")
    found = commands([page])
    assert [line.split(": ", 1)[1] for line in _uncovered(invocations([page]))] == [
        "crate-clip shards folder pics --out data/new_shards",
        "deepspeed --module crate_clip.train.cli --config C.yaml --resum auto", "crate-clip export --stagee 0",
        "crate-clip eval zeroshot --workers 2"]
    assert [line.rsplit(": ", 1)[1] for line in _option_problems(found)] == [
        "`crate-clip train` has no option --resum", "`crate-clip export` has no option --stagee",
        "`crate-clip eval zeroshot` has no option --workers", "no command `crate-clip plann`"]
    page.write_text("Run `make demoo`, `python -m crate_clip.no_such` or `crate-clip plan configs/nope.yaml --gpus 8`.")
    assert [line.rsplit(": ", 1)[1] for line in _missing_names(commands([page]))] == [
        "no Makefile target demoo", "no module crate_clip.no_such", "no configs/nope.yaml in the checkout"]


def _missing_names(cmds: list) -> list[str]:
    """The Makefile targets, `python -m` modules and configs/ or bench/ paths `cmds` name that do not exist."""
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))
    wrong = []
    for cmd in cmds:
        words = _shell_words(cmd.text)
        if words[0] == "make" and len(words) > 1 and words[1] not in targets:
            wrong.append(f"{_where(cmd)}: no Makefile target {words[1]}")
        if words[0] in ("python", "python3") and len(words) > 2 and words[1] == "-m":
            if words[2] not in OTHER_TOOLS and importlib.util.find_spec(words[2]) is None:
                wrong.append(f"{_where(cmd)}: no module {words[2]}")
        for word in words:
            if re.match(r"(configs|bench)/[\w./-]+$", word) and not (ROOT / word).exists():
                wrong.append(f"{_where(cmd)}: no {word} in the checkout")
    return wrong


def test_every_named_target_module_and_path_exists():
    wrong = _missing_names(commands())
    assert not wrong, "\n".join(wrong)
    run = {w[2] for w in map(_shell_words, (c.text for c in commands())) if w[:2] in (["python", "-m"],
                                                                                      ["python3", "-m"])}
    assert set(OTHER_TOOLS) <= run, f"OTHER_TOOLS no page runs any more (remove them): {set(OTHER_TOOLS) - run}"


# ------------------------------------------------------------------------------------- no untracked files left
def _untracked(paths: list[str]) -> list[str]:
    """Those of `paths` (relative to the repository root) that git would list as untracked there."""
    if not paths:
        return []
    done = subprocess.run(["git", "-C", str(ROOT), "check-ignore", "--no-index", "--stdin", "-v", "-n"],
                          input="\n".join(paths) + "\n", capture_output=True, text=True, timeout=60)
    assert done.returncode in (0, 1), done.stderr
    return [line.split("\t", 1)[1] for line in done.stdout.splitlines() if line.startswith("::\t")]


def _output_paths(cmd) -> list[str]:
    """The relative paths a command names as its outputs (its output options; sbatch's --output)."""
    words = _shell_words(cmd.text)
    named = [words[i + 1] for i, w in enumerate(words[:-1]) if w in OUTPUT_OPTIONS]
    named += [w.split("=", 1)[1] for w in words if w.split("=")[0] in OUTPUT_OPTIONS and "=" in w]
    if cmd.kind == "script":   # the #SBATCH lines of the script a page shows
        body = next(m.group(2) for m in FENCE.finditer((ROOT / cmd.page).read_text()) if cmd.text in m.group(2))
        named += re.findall(r"^#SBATCH .*--output=(\S+)", body, re.M)
    return [p.rstrip("/") + ("/x" if p.endswith("/") else "") for p in named
            if not p.startswith(("/", "~", "$")) and p not in STAND_INS]


def test_no_documented_output_is_an_untracked_file():
    assert _untracked(["runs/x/y", "exports/day3/w", "data/s/0.tar", "maps/a.png", "notes.txt"]) == ["maps/a.png",
                                                                                                   "notes.txt"]
    named = {p: _where(c) for c in commands() for p in _output_paths(c)}
    for config in sorted((ROOT / "configs").rglob("*.yaml")):   # where runs go: every shipped config's output_dir
        output_dir = yaml.safe_load(config.read_text())["run"]["output_dir"]
        named[f"{output_dir}/x"] = str(config.relative_to(ROOT))
    named["runs/fashion_mnist_demo/x"] = named["data/fashion_mnist/x"] = "the demo's default folders"
    left = _untracked(sorted(named))
    assert not left, "outputs git would show as untracked:\n" + "\n".join(f"{p} ({named[p]})" for p in left)


# -------------------------------------------------------------------------------------------- run them here
@pytest.fixture(scope="module")
def checkout_like(tmp_path_factory, fashion_mnist_dir) -> Path:
    """The stand-ins, laid out as STAND_INS names them: two tiny shards, a class folder, a caption table, the demo
    config's shards and test folder, and configs/ (a link to the checkout's); and where the pages name what the demo
    writes, that path holds a small one: runs/fashion_mnist_demo/export (the untrained tiny CLIP), the probe's
    training folder, data/fmnist_wds (40 test images), a.png and b.png."""
    import open_clip
    from PIL import Image

    from crate_clip.data.sources.fashion_mnist import (load_fashion_mnist, write_fashion_mnist_classification_shards,
                                                       write_fashion_mnist_eval_folder)
    from crate_clip.export.writer import export_open_clip
    from data_fixtures import write_numbered_shards

    root = tmp_path_factory.mktemp("checkout")
    write_numbered_shards(root / "shards", 64, 32, fashion_mnist_dir)
    demo_data = root / "data" / "fashion_mnist"
    write_numbered_shards(demo_data / "train", 64, 32, fashion_mnist_dir)
    write_fashion_mnist_eval_folder(demo_data / "test", "test", fashion_mnist_dir, limit=20)
    write_fashion_mnist_eval_folder(demo_data / "probe_train_10000", "train", fashion_mnist_dir, limit=20)
    write_fashion_mnist_classification_shards(root / "data" / "fmnist_wds", "test", source_dir=fashion_mnist_dir,
                                              limit=40)
    export_open_clip(open_clip.create_model("CRATE-alpha-CLIPA-tiny").state_dict(), "CRATE-alpha-CLIPA-tiny",
                     root / "runs" / "fashion_mnist_demo" / "export", image_size=28, context_length=16)
    images, _ = load_fashion_mnist("test", fashion_mnist_dir)
    for i, name in enumerate(("a.png", "b.png")):
        Image.fromarray(images[i]).save(root / name)
    for cls, color in (("golden_retriever", (200, 150, 50)), ("red_car", (220, 0, 0))):
        (root / "pictures" / "by_class" / cls).mkdir(parents=True)
        for i in range(2):
            Image.new("RGB", (40, 30), color).save(root / "pictures" / "by_class" / cls / f"{i}.png")
    (root / "captions.tsv").write_text("path\ttext\npictures/by_class/red_car/0.png\ta red car parked\n"
                                       "pictures/by_class/golden_retriever/1.png\ta happy dog\n")
    (root / "configs").symlink_to(ROOT / "configs")
    return root


def _files(root: Path) -> set[str]:
    return {str((Path(d) / f).relative_to(root)) for d, _, fs in os.walk(root) for f in fs}


def _shown_output(cmd) -> list[str]:
    """The lines a page prints under a `$ ` command (up to the next `$ ` line or the block's end)."""
    lines = (ROOT / cmd.page).read_text().splitlines()[cmd.line:]
    shown = []
    for line in lines:
        if line.startswith(("$ ", "```")):
            break
        if not (shown == [] and line.startswith("    ")):   # the command's own continuation lines
            shown.append(line)
    return shown


RUNS = {c.text: c for c in invocations() if c.text in RUN_HERE}


@pytest.mark.parametrize("text", sorted(RUN_HERE), ids=lambda text: " ".join(text.split()[:4]))
def test_documented_command_runs_here_and_leaves_no_untracked_file(text, checkout_like, tmp_path, monkeypatch):
    from crate_clip.cli import main

    if "emoji" in text and not Path("/usr/share/fonts/truetype/noto/NotoColorEmoji.ttf").is_file():
        pytest.skip("fonts-noto-color-emoji is not installed")
    run, cmd = RUN_HERE[text], RUNS[text]
    writes = [w for i, w in enumerate(text.split()) if i and text.split()[i - 1] == "--out"]
    for name in os.listdir(checkout_like):   # each command in a fresh folder holding links to the stand-ins,
        if name in ("data", "runs"):           # with data/ and runs/ of its own, the folder it writes not linked
            (tmp_path / name).mkdir()
            for sub in os.listdir(checkout_like / name):
                # a run folder only where the command names it: a fresh checkout has none, and `train` refuses
                # an output folder that holds a run (the demo's export stands in for one)
                if f"{name}/{sub}" not in writes and (name != "runs" or f"runs/{sub}/" in text):
                    (tmp_path / name / sub).symlink_to(checkout_like / name / sub)
        else:
            (tmp_path / name).symlink_to(checkout_like / name)
    before = _files(tmp_path)
    for placeholder, stand_in in STAND_INS.items():
        text = text.replace(placeholder, stand_in)
    words = argv(text.replace("[", "").replace("]", ""))   # an optional part shown in brackets is run too
    assert words[0] == "crate-clip"
    monkeypatch.chdir(tmp_path)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(words[1:] + list(run.extra))
        except SystemExit as exc:   # argparse's refusals
            code = exc.code
    printed = out.getvalue() + err.getvalue()
    assert code == run.code, printed[-3000:]
    if cmd.kind == "output" and run.code == 0:   # a result shown whole: the page has every line it prints
        assert out.getvalue().rstrip("\n").splitlines() == _shown_output(cmd), out.getvalue()
    for line in _shown_output(cmd) if cmd.kind == "output" else []:   # an error shown by its telling lines
        pattern = ".*".join(re.escape(part) for part in line.split("..."))
        assert re.search(pattern, printed), f"{cmd.page} shows {line!r}; the command printed:\n{printed[-2000:]}"
    written = sorted(_files(tmp_path) - before)
    if "--out" in words and code == 0:   # the outputs landed here, so the check below sees them
        assert any(w.startswith(words[words.index("--out") + 1]) for w in written), written
    assert not _untracked(written), f"untracked in a checkout: {_untracked(written)}"

