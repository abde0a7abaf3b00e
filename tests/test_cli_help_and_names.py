"""The `crate-clip` command's surface: `--help` of every sub-command exits 0 with help on every option, a
`--version`, hyphenated names with the old ones kept as aliases, train and plan taking the config alike, rates in
the unit that fits; and `import crate_clip` stays cheap (no torch) while still registering the CRATE towers with
timm and open_clip whichever is imported first."""
import argparse
import subprocess
import sys

import pytest

import warm_python
from train_fixtures import run_env

from crate_clip.cli import SUBCOMMANDS, main

PARSERS = {"eval": ("crate_clip.eval.cli", "build_parser"), "shards": ("crate_clip.data.cli", "_parser"),
           "plan": ("crate_clip.train.plan_cli", "build_parser"), "train": ("crate_clip.train.cli", "build_parser"),
           "export": ("crate_clip.export.cli", "build_parser"), "demo": ("crate_clip.train.demo", "build_parser"),
           "convert": ("crate_clip.convert_cli", "build_parser"), "models": ("crate_clip.models_cli", "build_parser"),
           "segment": ("crate_clip.eval.whitebox_cli", "segment_parser")}


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
    # bare, as a sub-command without its arguments (argparse's convention): usage on stderr, exit code 2
    assert main([]) == 2 == _help_exit(["eval"])
    bare, eval_bare = capsys.readouterr().err.split("usage: crate-clip eval", 1)
    assert bare.startswith("usage: crate-clip") and "--version" in bare and bare.rstrip().endswith(
        "crate-clip: error: the following arguments are required: <command>")
    assert "error: the following arguments are required: command" in eval_bare


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
    from crate_clip.eval.cli import build_parser, canonical_argv

    new = build_parser().parse_args(["linear-probe", "--model", "m", "--data", "d", "--train-data", "t"])
    old = build_parser().parse_args(canonical_argv(["linear_probe", "--model", "m", "--data", "d", "--train-data",
                                                    "t"]))
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
    from crate_clip.train.reporting.metrics_log import flop_rate

    assert flop_rate(0.0123, on_gpu=False) == ("GFLOP/s/rank", "12.3")
    assert flop_rate(312.46, on_gpu=True) == ("TFLOP/s/gpu", "312.5")


def _python(code: str, base: str | None = None) -> str:
    """`python -c code`'s output: a fresh interpreter, or one forked from the warm one of `base` (warm_python.BASES)
    where only the imports after it are the point."""
    if base:
        done = warm_python.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, base=base,
                               env=run_env())   # one thread, as the suite's commands
    else:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_import_crate_clip_and_help_import_no_torch():
    out = _python("import sys, crate_clip\nfrom crate_clip.cli import main\nmain(['--help'])\n"
                  "print(sorted(m for m in ('torch', 'timm', 'open_clip') if m in sys.modules))")
    assert out.strip().splitlines()[-1] == "[]"


# `--help` builds the parser from light modules; the command imports torch & co. once parsed (`eval`'s options
# come from the settings schema in each task's file, eval/tasks/NAME.py, which imports torch only to run the task).
LIGHT_HELP = [["train"], ["plan"], ["export"], ["convert"], ["demo"], ["models"], ["shards"], ["inspect"],
              ["inspect", "maps"],
              ["inspect", "text"], ["segment"], ["eval"], ["eval", "zeroshot"], ["eval", "linear-probe"],
              ["eval", "retrieval"]]


@pytest.mark.parametrize("argv", LIGHT_HELP, ids=" ".join)
def test_subcommand_help_imports_no_torch(argv):
    out = _python("import sys\nfrom crate_clip.cli import main\ntry:\n"
                  f"    code = main({argv + ['--help']!r})\nexcept SystemExit as exc:\n    code = exc.code\n"
                  "print(code, sorted(m for m in ('torch', 'timm', 'open_clip', 'deepspeed') if m in sys.modules))")
    assert out.strip().splitlines()[-1] == "0 []", out[-2000:]


def test_the_launchers_checks_import_no_model_stack(tmp_path):
    """`crate-clip train --nproc N` checks the whole config before it starts any worker, then starts them: it imports
    torch (torchrun) but not timm, open_clip, torchvision, transformers or DeepSpeed, seconds of CPU before the first
    worker starts that only the workers use. --validate runs the same checks; the missing data makes it exit 2, after
    every check ran."""
    out = _python("import sys\nfrom crate_clip.cli import main\nimport crate_clip.train.worker_launch\n"
                  f"code = main(['train', 'configs/demo/fashion_mnist.yaml', '--validate', '--set', "
                  f"'data.sources=[{tmp_path}/none]', '--set', 'run.output_dir={tmp_path}/run'])\n"
                  "print(code, sorted(m for m in ('timm', 'open_clip', 'torchvision', 'transformers', 'deepspeed') "
                  "if m in sys.modules))", base="torch")
    assert out.strip().splitlines()[-1] == "2 []", out[-2000:]


def test_each_task_module_has_its_settings_and_the_parts_the_cli_names():
    import pkgutil

    import crate_clip.eval.tasks
    from crate_clip.eval.registry import TASK_SETTINGS, task_module

    modules = sorted(i.name for i in pkgutil.iter_modules(crate_clip.eval.tasks.__path__) if not i.name.startswith("_"))
    assert sorted(TASK_SETTINGS) == modules == ["linear_probe", "retrieval", "zeroshot"]
    for name, settings in TASK_SETTINGS.items():
        task = task_module(name)
        assert settings.model_fields["type"].default == name   # a config's `type: NAME` is the file NAME.py
        assert task.Settings is settings and callable(task.run) and callable(task.summary)
        assert hasattr(task, "details") == settings.has_details   # `--details` is offered exactly where it works


def test_task_modules_import_no_torch():
    """Each task's file holds its settings and is imported for --help and config checks: torch, open_clip and
    numpy wait until the task runs. One interpreter imports every module of eval/tasks/ and the registry."""
    out = _python("import importlib, pkgutil, sys\nimport crate_clip.eval.tasks as tasks\n"
                  "names = sorted(m.name for m in pkgutil.iter_modules(tasks.__path__))\n"
                  "for name in names:\n    importlib.import_module(f'crate_clip.eval.tasks.{name}')\n"
                  "import crate_clip.eval.registry\n"
                  "print(names, sorted(m for m in ('torch', 'timm', 'open_clip', 'numpy') if m in sys.modules))")
    assert out.strip().splitlines()[-1] == "['linear_probe', 'retrieval', 'zeroshot'] []", out[-2000:]


@pytest.mark.parametrize("order", ["import crate_clip, timm, open_clip", "import open_clip, crate_clip",
                                   "import timm, crate_clip, open_clip", "import crate_clip, open_clip"])
def test_crate_towers_are_registered_in_either_import_order(order):
    # torch imported before (the interpreter of base "torch"): the order of crate_clip, timm and open_clip is the
    # command's own
    out = _python(f"{order}\nimport timm, open_clip\n"
                  "print('crate_alpha_tiny_patch16_224' in timm.list_models('crate*'),"
                  " 'CRATE-alpha-CLIPA-tiny' in open_clip.list_models())", base="torch")
    assert out.split() == ["True", "True"]


# ---------------------------------------------------------------- one CLI convention (issue 42 item 7)
OLD_NAMES = {"--workers": "--num-workers", "--limit": "--max-images", "--train-images": "--max-train-images",
             "--test-images": "--max-test-images"}


def _parser(name):
    import importlib

    module, builder = PARSERS[name]
    return getattr(importlib.import_module(module), builder)()


def _visible_options(name):
    return {(path, o) for path, p in _all_parsers(_parser(name), name) for a in p._actions
            if a.help != argparse.SUPPRESS for o in a.option_strings}


def test_one_name_for_one_thing_across_commands():
    shown = set().union(*(_visible_options(name) for name in PARSERS))
    assert not {o for _, o in shown} & set(OLD_NAMES)   # the old names are accepted, never offered
    assert {path for path, o in shown if o == "--num-workers"} == {"eval zeroshot", "eval retrieval",
                                                                   "eval linear-probe", "shards inspect"}
    assert {path for path, o in shown if o == "--max-images"} >= {"eval zeroshot", "shards fashion-mnist",
                                                                  "shards emoji", "shards eval-shards", "segment"}


@pytest.mark.parametrize("name, old, new", [
    ("eval", ["zeroshot", "--model", "m", "--data", "d", "--workers", "3"],
     ["zeroshot", "--model", "m", "--data", "d", "--num-workers", "3"]),
    ("shards", ["emoji", "--out", "o", "--limit", "5"], ["emoji", "--out", "o", "--max-images", "5"]),
    ("demo", ["--train-images", "64", "--test-images", "10"], ["--max-train-images", "64", "--max-test-images", "10"]),
    ("segment", ["--model", "m", "--data", "d", "--out", "o", "--limit", "7"],
     ["--model", "m", "--data", "d", "--out", "o", "--max-images", "7"]),
], ids=["eval", "shards", "demo", "segment"])
def test_old_names_still_work_with_one_deprecation_line(name, old, new, capsys):
    assert _parser(name).parse_args(old) == _parser(name).parse_args(new)
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == len([a for a in old if a in OLD_NAMES]) and all("is deprecated; use --" in x for x in lines)


def test_the_old_task_name_warns(capsys):
    assert _help_exit(["eval", "linear_probe", "--help"]) == 0
    assert "crate-clip eval: linear_probe is deprecated; use linear-probe" in capsys.readouterr().err


@pytest.mark.parametrize("argv, says", [
    (["trian"], "unknown command 'trian' (did you mean 'train'?)"),
    (["eval", "zeroshot", "--model", "m", "--data", "d", "--num-workerz", "1"],
     "unrecognized arguments: --num-workerz (did you mean '--num-workers'?) 1"),
    (["eval", "linear-prob"], "(did you mean 'linear-probe'?)"),
    (["shards", "fashion_mnist"], "(did you mean 'fashion-mnist'?)"),
    (["plan", "c.yaml", "--gpus", "1", "--gpu-memroy", "80GiB"], "(did you mean '--gpu-memory'?)"),
    (["export", "run", "--repo-ulr", "x"], "(did you mean '--repo-url'?)"),
    (["inspect", "mapz"], "unknown command 'mapz' (did you mean 'maps'?)"),
    # another command's name for the same thing, not the nearest spelling (--max-objects)
    (["shards", "scenes", "--out", "s", "--max-images", "50"],
     "unrecognized arguments: --max-images (did you mean '--count'?) 50"),
    (["train", "c.yaml", "--nproc_per_node", "2"], "(did you mean '--nproc'?)"),
])
def test_a_mistyped_command_or_option_gets_a_did_you_mean(argv, says, capsys):
    assert _help_exit(argv) == 2
    assert says in capsys.readouterr().err


def test_json_wherever_a_command_has_a_result():
    with_json = {path for name in PARSERS for path, o in _visible_options(name) if o == "--json"}
    assert {"eval zeroshot", "eval retrieval", "eval linear-probe", "export", "convert official", "plan", "models",
            "shards fashion-mnist", "shards inspect", "shards scenes"} <= with_json


def test_models_lists_each_registered_config_with_its_parameters_and_flops(capsys):
    import json

    import open_clip
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    import crate_clip  # noqa: F401
    from crate_clip.models.clip_factory import create_clip
    from crate_clip.models_cli import registered_models

    assert main(["models", "--json", "--filter", "clipa-tiny-w64"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["name"] in open_clip.list_models() and row["name"] in registered_models()
    model = create_clip(row["name"]).eval()   # a real build, counted here without the planner's cut towers
    assert row["params"] == sum(p.numel() for p in model.parameters())
    assert row["image_params"] == sum(p.numel() for p in model.visual.parameters())
    # attention as its matmuls, as the planner counts it (the counter has no formula for the fused CPU kernel)
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(torch.zeros(1, 3, row["image_size"], row["image_size"]),
              torch.ones(1, row["context_length"], dtype=torch.long))
    # the planner's forward also holds the contrastive logits of its 2-sample batch: a few hundred FLOPs more
    assert row["forward_gflops"] * 1e9 == pytest.approx(counter.get_total_flops(), rel=1e-4)
    assert 2.5 < row["train_gflops"] / row["forward_gflops"] < 3.5   # backward ~ twice the forward
    assert main(["models", "--filter", "no-such-model"]) == 2


def test_models_weights_lists_the_released_weights_each_loading_into_a_model_that_exists(capsys):
    """`crate-clip models --weights`: each entry's model is registered (open_clip config, timm name, open_clip's
    pretrained tag at the hub repository it names), and a CLIPA tower is offered as CRATE-alpha-CLIPA's text tower
    (model.text_pretrained) exactly when its text config has that tower's shape."""
    import json

    import open_clip
    import timm
    from open_clip.pretrained import get_pretrained_cfg

    import crate_clip  # noqa: F401

    assert main(["models", "--weights", "--json"]) == 0
    entries = json.loads(capsys.readouterr().out)
    names = [e["name"] for e in entries]
    assert names[:2] == ["CRATE-α-CLIPA-L/14", "CRATE-α-CLIPA-H/14"] and names[-1] == "your export"
    assert "2.56 GB, 640,165,889 fp32 values" in entries[0]["size"] and "69.8%" in entries[0]["reported"]
    def text_shape(name: str) -> dict:   # what sets the text tower's keys and shapes (docs/text_lock.md)
        text = open_clip.get_model_config(name)["text_cfg"]
        return {k: text.get(k) for k in ("width", "layers", "heads", "mlp_ratio", "context_length", "vocab_size")}

    crate_text = text_shape("CRATE-alpha-CLIPA-L-14")
    for entry in entries:
        kind, _, target = entry["loads_into"].partition(":")
        if kind == "timm":
            assert target in timm.list_models("crate_alpha*"), entry["name"]
        elif kind == "open_clip":
            config, _, tag = target.partition(":")
            assert open_clip.get_model_config(config) is not None, entry["name"]
            if tag:   # a hub checkpoint: open_clip's own tag for it, at the repository listed
                assert entry["where"] == f"hf-hub:{get_pretrained_cfg(config, tag)['hf_hub'].rstrip('/')}"
                fits = text_shape(config) == crate_text
                assert fits == ("model.text_pretrained" in entry["load"]), entry["name"]
        else:
            assert entry["name"] in ("CRATE-α (JAX)", "your export")
    assert main(["models", "--weights"]) == 0
    printed = capsys.readouterr().out
    assert all(f"{name}: " in printed for name in names) and "local-dir:EXPORT" in printed
    assert main(["models", "--weights", "--filter", "no-such-weights"]) == 2
