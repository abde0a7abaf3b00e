"""The `crate-clip` command's surface: `--help` of every sub-command exits 0 with help on every option, a
`--version`, hyphenated names with the old ones kept as aliases, train and plan taking the config alike, rates in
the unit that fits; and `import crate_clip` stays cheap (no torch) while still registering the CRATE towers with
timm and open_clip whichever is imported first."""
import argparse
import subprocess
import sys

import pytest

from crate_clip.cli import SUBCOMMANDS, main

PARSERS = {"eval": ("crate_clip.eval.cli", "build_parser"), "shards": ("crate_clip.data.cli", "_parser"),
           "plan": ("crate_clip.train.plan_cli", "build_parser"), "train": ("crate_clip.train.cli", "build_parser"),
           "export": ("crate_clip.export.cli", "build_parser")}


def _help_exit(argv) -> int:
    try:
        return main(argv)
    except SystemExit as exc:   # argparse's --help
        return exc.code


@pytest.mark.parametrize("name", list(SUBCOMMANDS))
def test_every_subcommand_help_exits_0(name, capsys):
    assert _help_exit([name, "--help"]) == 0
    assert "usage" in capsys.readouterr().out.lower()


def test_version_and_top_level_help(capsys):
    from crate_clip import __version__

    assert main(["--version"]) == 0 and capsys.readouterr().out.strip() == f"crate-clip {__version__}"
    assert main(["--help"]) == 0 and "--version" in capsys.readouterr().out


def _all_parsers(parser: argparse.ArgumentParser, path: str):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _all_parsers(sub, f"{path} {sub_name}")


@pytest.mark.parametrize("name", list(PARSERS))
def test_every_option_has_help_text(name):
    import importlib

    module, builder = PARSERS[name]
    parser = getattr(importlib.import_module(module), builder)()
    missing = [f"{path} {'/'.join(a.option_strings) or a.dest}"
               for path, p in _all_parsers(parser, name) for a in p._actions
               if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))
               and a.help != argparse.SUPPRESS and not (a.help or "").strip()]
    assert not missing, missing


def test_eval_names_are_hyphenated_and_the_old_ones_still_work():
    from crate_clip.eval.cli import build_parser

    new = build_parser().parse_args(["linear-probe", "--model", "m", "--data", "d", "--train-data", "t"])
    old = build_parser().parse_args(["linear_probe", "--model", "m", "--data", "d", "--train-data", "t"])
    assert new.task == old.task == "linear_probe"


def test_train_and_plan_take_the_config_both_ways():
    from crate_clip.train import cli as train_cli, plan_cli

    assert train_cli.build_parser().parse_args(["a.yaml"]).config == "a.yaml"
    assert train_cli.build_parser().parse_args(["--config", "a.yaml"]).config_option == "a.yaml"
    assert "docs/config.md" in train_cli.build_parser().format_help()
    assert plan_cli.build_parser().parse_args(["--config", "a.yaml", "--gpus", "1"]).config_option == "a.yaml"
    with pytest.raises(SystemExit):
        train_cli.main(["a.yaml", "--config", "b.yaml"])


def test_flop_rates_print_in_the_unit_that_fits():
    from crate_clip.train.metrics_log import flop_rate

    assert flop_rate(0.0123, on_gpu=False) == ("GFLOP/s/rank", "12.3")
    assert flop_rate(312.46, on_gpu=True) == ("TFLOP/s/gpu", "312.5")


def _python(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_import_crate_clip_and_help_import_no_torch():
    out = _python("import sys, crate_clip\nfrom crate_clip.cli import main\nmain(['--help'])\n"
                  "print(sorted(m for m in ('torch', 'timm', 'open_clip') if m in sys.modules))")
    assert out.strip().splitlines()[-1] == "[]"


# `--help` builds the parser from light modules; the command imports torch & co. once parsed (`eval`'s options
# come from the tasks' settings schemas, crate_clip.eval.task_settings, apart from the tasks' code).
LIGHT_HELP = [["train"], ["plan"], ["export"], ["convert"], ["demo"], ["shards"], ["inspect"], ["inspect", "maps"],
              ["inspect", "text"], ["segment"], ["eval"], ["eval", "zeroshot"], ["eval", "linear-probe"],
              ["eval", "retrieval"]]


@pytest.mark.parametrize("argv", LIGHT_HELP, ids=" ".join)
def test_subcommand_help_imports_no_torch(argv):
    out = _python("import sys\nfrom crate_clip.cli import main\ntry:\n"
                  f"    code = main({argv + ['--help']!r})\nexcept SystemExit as exc:\n    code = exc.code\n"
                  "print(code, sorted(m for m in ('torch', 'timm', 'open_clip', 'deepspeed') if m in sys.modules))")
    assert out.strip().splitlines()[-1] == "0 []", out[-2000:]


def test_each_task_module_has_its_settings_registered_and_the_parts_the_cli_names():
    import pkgutil

    import crate_clip.eval.tasks
    from crate_clip.eval.registry import task_module
    from crate_clip.eval.task_settings import TASK_SETTINGS

    modules = sorted(i.name for i in pkgutil.iter_modules(crate_clip.eval.tasks.__path__) if not i.name.startswith("_"))
    assert sorted(TASK_SETTINGS) == modules   # a task file without registered settings (or the reverse) is caught
    for name, settings in TASK_SETTINGS.items():
        task = task_module(name)
        assert task.Settings is settings and callable(task.run) and callable(task.summary)
        assert hasattr(task, "details") == settings.has_details   # `--details` is offered exactly where it works


@pytest.mark.parametrize("order", ["import crate_clip, timm, open_clip", "import open_clip, crate_clip",
                                   "import timm, crate_clip, open_clip", "import crate_clip, open_clip"])
def test_crate_towers_are_registered_in_either_import_order(order):
    out = _python(f"{order}\nimport timm, open_clip\n"
                  "print('crate_alpha_tiny_patch16_224' in timm.list_models('crate*'),"
                  " 'CRATE-alpha-CLIPA-tiny' in open_clip.list_models())")
    assert out.split() == ["True", "True"]
