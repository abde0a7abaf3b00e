"""Tests only: the shell commands README.md and docs/ show, as a reader would copy them.

A command is
- a line of a ```bash / ```sh / ```console block (a `\\` continuation joined, a trailing `# comment` dropped); a
  block that starts with `#!` is one script, named by its first command line (its other lines are checked against
  the code, not run one by one);
- a `$ ` line of a plain ``` block (a command shown with its output);
- an inline `code` span that starts with a program (crate-clip, python, make, deepspeed, ...) and gives it a value
  (`crate-clip shards emoji --out data/emoji`, `make demo`). A span that only names a command or an option
  (`crate-clip plan`, `crate-clip train --validate`, `crate-clip eval zeroshot ...`, `eval/inspect/segment`, a
  line it prints) is a mention: its sub-command
  and options are checked against the real parser (test_doc_commands.py), it is not run.
"""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
INLINE = re.compile(r"`([^`\n]+)`")
SHELL = ("bash", "sh", "console", "shell")
PROGRAMS = ("crate-clip", "python", "python3", "make", "deepspeed", "torchrun", "accelerate", "hf", "huggingface-cli",
            "pip", "sbatch", "tensorboard", "srun", "uv", "wandb")
# Words that name a program's sub-command, not a value given to it (`accelerate launch`, `hf download` alone).
SUBCOMMAND_WORDS = {"accelerate": {"launch"}, "hf": {"download", "upload"}, "wandb": {"sync", "login"}}
# Placeholders a mention may hold without becoming a command: upper-case words and "..."
PLACEHOLDER = re.compile(r"^(\.\.\.|[A-Z][A-Z_]*|<[^>]+>|\[.*\])$")


@dataclass(frozen=True)
class Command:
    page: str     # "docs/data.md"
    line: int     # where it starts
    text: str     # the command, continuations joined, whitespace collapsed, trailing comment dropped
    kind: str     # "block", "output" (a `$ ` line), "inline", "script"

    @property
    def key(self) -> str:
        return f"{self.page}: {self.text}"


def _strip_comment(line: str) -> str:
    """`line` without a trailing shell comment (a `#` after whitespace, outside quotes)."""
    quote = None
    for i, c in enumerate(line):
        if quote:
            quote = None if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def _logical_lines(body: str, first_line: int):
    """(line number, text) of each command of a block body: continuations joined, comments dropped."""
    pending, start = [], None
    for n, raw in enumerate(body.splitlines()):
        text = _strip_comment(raw) if not pending else raw.rstrip()
        if not pending:
            start = first_line + n
        if text.endswith("\\"):
            pending.append(text[:-1].strip())
            continue
        pending.append(_strip_comment(text).strip())
        joined = " ".join(p for p in pending if p)
        pending = []
        if joined:
            yield start, joined


def _collapse(text: str) -> str:
    return " ".join(text.split())


def _is_invocation(span: str) -> bool:
    """An inline span gives its program a value (it is a command to run), rather than naming a command or option."""
    words = span.split()
    if words[0] not in PROGRAMS or len(words) == 1 or "..." in span or " | " in span:
        return False
    if words[0] == "crate-clip" and (any(w.endswith(":") for w in words[1:3]) or "/" in words[1]):
        return False   # a line it prints; `eval/inspect/segment`
    if words[0] in ("python", "python3"):
        return True
    rest = [w for w in words[1:] if w not in SUBCOMMAND_WORDS.get(words[0], ())]
    if words[0] == "crate-clip":
        rest = _after_subcommands(words[1:])
    values = [w for i, w in enumerate(rest) if not w.startswith("-") and not PLACEHOLDER.match(w)]
    return bool(values)


def _after_subcommands(args: list[str]) -> list[str]:
    """`crate-clip` arguments after its sub-command words (`shards inspect`, `eval zeroshot`, `inspect maps`)."""
    nested = {"eval", "shards", "inspect", "convert"}
    skip = 2 if args and args[0] in nested else 1
    return args[skip:]


def commands(pages=PAGES) -> list[Command]:
    """Every command of the pages, in page order."""
    found = []
    for page in pages:
        text = page.read_text()
        name = str(page.relative_to(ROOT) if page.is_relative_to(ROOT) else page)
        fenced_lines = set()
        for m in FENCE.finditer(text):
            lang, body = m.group(1), m.group(2)
            first = text[:m.start()].count("\n") + 2
            fenced_lines.update(range(first - 1, first + body.count("\n") + 1))
            if lang in SHELL and body.startswith("#!"):
                lines = [(n, _collapse(c)) for n, c in _logical_lines(body, first)]
                found.append(Command(name, lines[0][0], lines[0][1], "script"))
                found += [Command(name, n, c, "script line") for n, c in lines[1:]]
            elif lang in SHELL:
                found += [Command(name, n, _collapse(c), "block") for n, c in _logical_lines(body, first)]
            elif lang == "":
                lines = body.splitlines()
                for i, raw in enumerate(lines):
                    if raw.startswith("$ "):
                        joined, j = raw[2:], i
                        while joined.endswith("\\"):
                            j += 1
                            joined = joined[:-1] + " " + lines[j]
                        found.append(Command(name, first + i, _collapse(joined), "output"))
        for n, line in enumerate(text.splitlines(), 1):
            if n in fenced_lines:
                continue
            for m in INLINE.finditer(line):
                span = m.group(1).strip()
                if span.split() and span.split()[0] in PROGRAMS:
                    found.append(Command(name, n, _collapse(span), "inline"))
    return found


def invocations(pages=PAGES) -> list[Command]:
    """The commands a reader runs: every block, output and script command, and the inline spans that give a value."""
    return [c for c in commands(pages) if c.kind in ("block", "output", "script") or
            (c.kind == "inline" and _is_invocation(c.text))]


def argv(text: str) -> list[str]:
    """A command's words as the shell splits them."""
    return shlex.split(text)


# ------------------------------------------------------------------------------------------------ where each runs
# Every command above is in exactly one of RUN_HERE, COVERED_BY and NOT_HERE (keyed by its text, whatever page shows
# it); test_doc_commands.py fails on a command in none of them and on an entry no page shows any more.

@dataclass(frozen=True)
class Run:
    """A command test_doc_commands.py runs as written, STAND_INS substituted, `extra` appended, in a temporary
    folder that holds the stand-ins (as the repository root would hold the data); `code`: its documented exit
    code. `dry`: the command is run with --validate only; what it does for real is run by the test named."""
    extra: tuple = ()
    code: int = 0
    dry: str = ""


# Tests that run several documented commands, each with its own small data.
DEMO = "tests/test_train_demo.py::test_demo_runs_end_to_end_on_a_few_images"
EMA_EXPORT = ("tests/test_train_resume.py::"
              "test_the_ema_weights_are_evaluated_beside_the_live_ones_and_exported_with_weights_ema")
DOC_EXPORTS = ("tests/test_checkpoint_rotation.py::"
               "test_keep_last_1_keeps_each_stage_end_and_the_docs_export_commands_run_as_written")
SLURM = ("tests/test_slurm_preemption.py::"
         "test_the_time_limit_warning_and_scancel_save_the_step_with_loader_workers_and_the_run_ends_as_undisturbed")
MULTINODE = "tests/test_multinode.py::"
SLURM_NO_REQUEUE = ("tests/test_slurm_preemption.py::"
                    "test_scancel_during_a_retried_outage_saves_and_exits_8_before_slurm_kills")
PLAN_RESUME = "tests/test_train_elastic.py::test_plan_for_a_run_in_progress_at_another_gpu_count"
LAUNCHED = "tests/test_train_launch_checks.py::test_launched_workers_exit_code_is_the_trainers_own"
PROBE = "tests/test_eval_linear_probe.py::test_cli_linear_probe_and_fewshot_on_a_clip_with_the_feature_cache"
CLIP_BENCHMARK = "tests/test_eval_clip_benchmark.py::test_clip_benchmark_gives_crate_clip_evals_numbers"
CLIP_BENCHMARK_FOLDER = ("tests/test_eval_clip_benchmark.py::"
                         "test_clip_benchmark_reads_the_demos_image_folder_as_documented")
CONVERT = "tests/test_models_clipa.py::test_official_file_through_eval_loader_and_convert_cli"   # a small model
# in the released layout, the tokenizer given offline

# The data a command names, and what stands in for it here (the tiny shards and images the fixture writes).
STAND_INS = {
    "pipe:aws s3 cp s3://my-bucket/datacomp1b/{00000000..00139827}.tar -": "pipe:cat shards/{00000000..00000001}.tar",
    "/data/datacomp1b/shards/{00000000..00139827}.tar": "shards/{00000000..00000001}.tar",
    "/d/{00000000..00000099}.tar": "shards/{00000000..00000001}.tar",
    "~/pictures/by_class": "pictures/by_class",
    "C.yaml": "configs/demo/fashion_mnist.yaml",
}
FEW = ("--max-images", "40")   # appended where a command would otherwise write all 60,000 / 10,000 images

RUN_HERE = {
    # docs/cli.md's mistakes and the lines they print (compared with the page)
    "crate-clip trian": Run(code=2),
    "crate-clip eval zeroshot --model m --data d --num-workerz 2": Run(code=2),
    "crate-clip shards fashion_mnist": Run(code=2),
    "crate-clip shards scenes --max-images 50 --out data/fmnist_scenes": Run(code=2),
    # reading shards (README, docs/data.md): the tiny shards for DataComp's, `cat` for `aws s3 cp`
    "crate-clip shards inspect '/data/datacomp1b/shards/{00000000..00139827}.tar' --image-size 84 "
    "--context-length 32": Run(),
    "crate-clip shards inspect '/data/datacomp1b/shards/{00000000..00139827}.tar' --image-size 84 "
    "--context-length 8": Run(),
    "crate-clip shards inspect 'pipe:aws s3 cp s3://my-bucket/datacomp1b/{00000000..00139827}.tar -' "
    "--num-samples 1400000000": Run(),
    # writing shards (docs/data.md's table, docs/export.md, docs/whitebox.md)
    "crate-clip shards folder ~/pictures/by_class --out data/my_shards": Run(),
    "crate-clip shards table captions.tsv --out data/my_shards --image-col path --caption-col text": Run(),
    "crate-clip shards fashion-mnist --split train --out data/fmnist_train --samples-per-shard 10000": Run(FEW),
    "crate-clip shards emoji --out data/emoji": Run(FEW),
    "crate-clip shards eval-folder --split test --out data/fmnist_val": Run(FEW),
    "crate-clip shards eval-shards --split test --out data/fmnist_wds": Run(FEW),
    "crate-clip shards scenes --out data/fmnist_scenes": Run(("--count", "4")),
    # on the demo's export (the untrained tiny CLIP stands in) and data (40 images)
    "crate-clip eval zeroshot --model local-dir:runs/fashion_mnist_demo/export --data data/fmnist_wds "
    "--dataset fashion_mnist --batch-size 500": Run(),
    "crate-clip eval zeroshot --model local-dir:runs/fashion_mnist_demo/export --data data/fashion_mnist/test "
    "--dataset fashion_mnist --batch-size 500": Run(),
    "crate-clip eval linear-probe --model local-dir:runs/fashion_mnist_demo/export --train-data "
    "data/fashion_mnist/probe_train_10000 --data data/fashion_mnist/test --dataset fashion_mnist": Run(),
    "crate-clip inspect maps --model local-dir:runs/fashion_mnist_demo/export --images a.png b.png --out runs/maps/ "
    "[--layer 1] [--image-size 56]": Run(),
    # refusals and checks
    "crate-clip plan --gpus 0": Run(code=2),
    "crate-clip train --config C.yaml --validate": Run(),
    "crate-clip train --config C.yaml --set stages.0.lr=1e-3 --set 'data.sources=[\"/d/{00000000..00000099}.tar\"]'":
        Run(("--validate",), dry=DEMO),
}

# Commands a test of their own runs (with its own small data and paths): the test that runs it.
COVERED_BY = {
    "make demo": DEMO,
    "python -m crate_clip.train.demo": DEMO,
    "python -m crate_clip.train.demo --set stages.0.samples=76800": DEMO,
    # docs/python_api.md: the smoke form, run in the wheel's fresh environment by hand; the test, the same sizes
    "crate-clip demo --data-dir data/smoke --run-dir runs/smoke --max-train-images 640 --max-test-images 100 "
    "--probe-train-images 100 --set stages.0.samples=640 --set stages.0.warmup_steps=2 --set stages.1.samples=128 "
    "--set stages.1.warmup_steps=0": DEMO,
    "python -m crate_clip.train.demo --resume":
        "tests/test_train_resume.py::test_demo_killed_in_its_inherited_patch_stage_resumes_bit_for_bit",
    "crate-clip train --config configs/demo/fashion_mnist.yaml": DEMO,
    "crate-clip plan configs/datacomp/crate_alpha_clipa_l-14.yaml --gpus 64 --gpu-memory 80GiB --gpu h100":
        "tests/test_doc_outputs.py::test_the_slow_blocks_are_current",   # BENCHMARKS.md's "plan l-14 memory"
    "crate-clip plan CONFIG --gpus 64 --gpu h100 --tune":
        "tests/test_train_planner_tune.py::test_a_tuned_config_is_written_and_plans_the_same",
    "crate-clip plan --resume runs/X": PLAN_RESUME,
    "crate-clip plan --resume runs/X --gpus 32 --gpu-memory 80GiB": PLAN_RESUME,
    "crate-clip train --config C.yaml --nproc 8": LAUNCHED,
    "crate-clip train --nproc 2": LAUNCHED,
    "crate-clip train --config C.yaml --resume latest":
        "tests/test_train_config_changes.py::"
        "test_a_changed_resume_is_refused_unless_named_then_recorded_and_scheduled_as_documented",
    "crate-clip train --config C.yaml --overwrite":
        "tests/test_train_run_dir.py::test_overwrite_moves_the_earlier_run_aside",
    "torchrun --nnodes 4 --nproc_per_node 8 --max-restarts 3 --rdzv_backend c10d --rdzv_endpoint node1:29500 "
    "--rdzv_id crate-b16 -m crate_clip.train.cli --config C.yaml --resume auto":
        "tests/test_train_elastic.py::test_torchrun_restarts_a_killed_rank_and_ends_with_the_uninterrupted_export",
    # docs/training.md#several-nodes: on two nodes of one machine (tests/two_nodes.py), one rank each
    "deepspeed --hostfile hostfile --num_nodes 4 --num_gpus 8 --master_addr node1 --module crate_clip.train.cli "
    "--config C.yaml": MULTINODE + "test_deepspeed_hostfile_launch_over_ssh_trains_what_one_node_trains",
    "torchrun --nnodes 4 --node_rank $R --nproc_per_node 8 --master_addr node1 --master_port 29500 -m crate_clip.cli "
    "train --config C.yaml": MULTINODE + "test_torchrun_two_static_nodes_train_what_one_node_trains",
    "torchrun --nnodes 2:4 --nproc_per_node 8 --max-restarts 3 --rdzv_backend c10d --rdzv_endpoint node1:29500 "
    "--rdzv_id crate-b16 -m crate_clip.train.cli --config C.yaml --resume auto":
        MULTINODE + "test_elastic_torchrun_survives_a_node_crash_and_takes_the_node_back",
    "sbatch --nodes=4 --ntasks-per-node=8 --gpus-per-node=8 configs/slurm/train.sbatch C.yaml":
        MULTINODE + "test_slurm_two_nodes_preempted_then_a_node_lost",
    "torchrun --nnodes 4": MULTINODE + "test_torchrun_two_static_nodes_train_what_one_node_trains",
    "torchrun --nnodes 2 --node_rank R": MULTINODE + "test_torchrun_two_static_nodes_train_what_one_node_trains",
    "torchrun --nnodes 1:2": MULTINODE + "test_elastic_torchrun_survives_a_node_crash_and_takes_the_node_back",
    "sbatch --nodes=2 configs/slurm/train.sbatch": MULTINODE + "test_slurm_two_nodes_preempted_then_a_node_lost",
    "head=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n 1)":   # both srun torchrun scripts
        MULTINODE + "test_slurm_torchrun_scripts_of_the_docs_on_two_nodes",
    "python tests/two_nodes.py up": MULTINODE + "test_the_two_node_script_makes_runs_on_and_removes_a_cluster",
    "python tests/two_nodes.py run crate-0000-n1 -- hostname":
        MULTINODE + "test_the_two_node_script_makes_runs_on_and_removes_a_cluster",
    "python tests/two_nodes.py down": MULTINODE + "test_the_two_node_script_makes_runs_on_and_removes_a_cluster",
    "sbatch configs/slurm/train.sbatch configs/datacomp/crate_alpha_clipa_b-16.yaml": SLURM,
    "sbatch --time=4:00:00 configs/slurm/train.sbatch C.yaml --no-requeue": SLURM_NO_REQUEUE,
    "set -eu":   # docs/training.md's copy of configs/slurm/train.sbatch, the script those tests submit
        "tests/test_slurm_preemption.py::test_the_docs_show_the_submitted_script",
    "crate-clip eval zeroshot --model runs/b16/checkpoints --data /data/imagenet/val --dataset imagenet1k "
    "--batch-size 256 --num-workers 8 --precision bf16 --output runs/b16/in1k.json":
        "tests/test_eval_cli.py::test_cli_zeroshot_writes_json_and_uses_the_cache",
    "crate-clip eval retrieval --model runs/b16/checkpoints --data '/data/coco_val/{00000000..00000004}.tar'":
        "tests/test_eval_cli.py::test_cli_retrieval",
    "crate-clip eval linear-probe ... --fewshot-k 10": PROBE,
    "crate-clip eval linear-probe --model timm:crate_alpha_base_patch16_224 --pretrained w.pth ...":
        "tests/test_eval_linear_probe.py::test_cli_linear_probe_on_a_timm_classifier_and_a_flat_folder",
    "crate-clip eval zeroshot --model CRATE-alpha-CLIPA-tiny --pretrained "
    "runs/fashion_mnist_demo/export/open_clip_model.safetensors --data data/fmnist_wds --dataset fashion_mnist":
        DOC_EXPORTS,
    "crate-clip export runs/my_run": DOC_EXPORTS,
    "crate-clip export --weights ema": EMA_EXPORT,
    "crate-clip export runs/my_run --weights ema": EMA_EXPORT,
    "crate-clip export CHECKPOINT --weights ema": EMA_EXPORT,
    "crate-clip export runs/my_run/checkpoints/stage0-step00010000 --out exports/day3": DOC_EXPORTS,
    "crate-clip export runs/my_run --stage 0": DOC_EXPORTS,
    "crate-clip export runs/my_run --out exports/my_model --hub-id my-org/crate-alpha-clipa-demo": DOC_EXPORTS,
    "make clip-benchmark": CLIP_BENCHMARK,
    ".venv-clip-benchmark/bin/python -c 'import sys, crate_clip; from clip_benchmark.cli import main; "
    "sys.exit(main())' eval --model_type open_clip --model local-dir:runs/fashion_mnist_demo/export --pretrained "
    "none --dataset wds/fmnist --dataset_root data/fmnist_wds --task zeroshot_classification --batch_size 500 "
    "--num_workers 0 --no_amp --output runs/fmnist_clip_benchmark.json": CLIP_BENCHMARK,
    ".venv-clip-benchmark/bin/python -c 'import json, sys; from crate_clip.eval.class_sets import builtin_templates, "
    "read_lines; folder, name = sys.argv[1:]; json.dump({name: read_lines(folder + \"/classnames.txt\")}, "
    "open(\"runs/cb_classnames.json\", \"w\")); json.dump({name: [t.replace(\"{}\", \"{c}\") for t in "
    "builtin_templates(\"fashion_mnist\")]}, open(\"runs/cb_templates.json\", \"w\"))' data/fashion_mnist/test "
    "fer2013": CLIP_BENCHMARK_FOLDER,
    ".venv-clip-benchmark/bin/python -c 'import sys, crate_clip; from clip_benchmark.cli import main; "
    "sys.exit(main())' eval --model_type open_clip --model local-dir:runs/fashion_mnist_demo/export --pretrained "
    "none --dataset fer2013 --dataset_root data/fashion_mnist --split test --task zeroshot_classification "
    "--custom_classname_file runs/cb_classnames.json --custom_template_file runs/cb_templates.json --batch_size 500 "
    "--num_workers 0 --no_amp --output runs/fmnist_folder_clip_benchmark.json": CLIP_BENCHMARK_FOLDER,
    "crate-clip shards inspect --mode epoch":
        "tests/test_data_reliability.py::test_shards_inspect_prints_samples_read_next_to_the_claimed_size",
    "crate-clip train --config configs/datacomp/crate_alpha_clipa_b-16.yaml --validate --set "
    "'data.sources=[\"pipe:aws s3 cp s3://bucket/{00000000..00139827}.tar -\"]' --set 'eval.evals=[]'":
        "tests/test_doc_outputs.py::test_every_generated_block_is_current",   # docs/safety.md's "validate b-16"
    "crate-clip models --filter tiny": "tests/test_doc_outputs.py::test_every_generated_block_is_current",   # cli.md
    "python -m crate_clip.config_docs": "tests/test_config_docs.py::test_committed_config_reference_is_current",
    "python -m crate_clip.doc_outputs": "tests/test_doc_outputs.py::test_check_reports_stale_pages_and_writes_nothing",
    "crate-clip convert official crate_alpha_CLIPA_H14.pth --model CRATE-alpha-CLIPA-H-14 --out exports/h14": CONVERT,
    "crate-clip convert official crate_alpha_CLIPA_L14.pth --out exports/clipa-l14": CONVERT,
    "python bench/bench_inverse_scaling.py":
        "tests/test_bench_inverse_scaling.py::test_smoke_run_trains_both_arms_and_writes_the_table_and_plot",
    "python bench/bench_inverse_scaling_law.py":   # its --quick form, in the same test as the study's --smoke
        "tests/test_bench_inverse_scaling.py::test_smoke_run_trains_both_arms_and_writes_the_table_and_plot",
    "python bench/bench_inverse_scaling_law.py --quick":
        "tests/test_bench_inverse_scaling.py::test_smoke_run_trains_both_arms_and_writes_the_table_and_plot",
}

# Commands that need what this machine lacks (GPUs, a cluster, the network, an account), or benchmarks of many
# minutes (their runs are in BENCHMARKS.md), with the reason.
NOT_HERE = {
    "make test": "the whole suite: what CI runs on a fresh clone (BENCHMARKS.md), not a test of itself",
    "make timm-model-tests": "downloads timm's sdist from PyPI and runs 200 of timm's tests (~10 min)",
    "deepspeed --num_gpus 8 --module crate_clip.train.cli --config configs/datacomp/crate_alpha_clipa_l-14.yaml "
    "--set 'data.sources=[\"/data/datacomp1b/shards/{00000000..00139827}.tar\"]' --set eval.evals.0.data="
    "/data/imagenet/val": "8 GPUs, DataComp-1B and ImageNet",
    "deepspeed --num_gpus 8 --module crate_clip.train.cli --config configs/datacomp/crate_alpha_clipa_l-14.yaml "
    "--set model.text_pretrained=/models/ViT-H-14-CLIPA-datacomp1B/open_clip_pytorch_model.bin --set "
    "'data.sources=[\"/datasets/datacomp1b/shards/{00000000..00139999}.tar\"]' --set eval.evals.0.data="
    "/datasets/imagenet/val": "8 GPUs, DataComp-1B, ImageNet and CLIPA's text tower from the hub",
    "torchrun --nproc_per_node 8 -m crate_clip.cli train --config C.yaml": "8 GPUs",
    "deepspeed --num_gpus 8 --module crate_clip.train.cli --config C.yaml": "8 GPUs",
    "accelerate launch --multi_gpu --num_processes 8 -m crate_clip.cli train --config C.yaml": "8 GPUs",
    "tensorboard --logdir runs/fashion_mnist_demo/tensorboard": "a server that runs until stopped",
    "crate-clip eval zeroshot --model CRATE-alpha-CLIPA-L-14 --pretrained crate_alpha_CLIPA_L14.pth --data "
    "/data/imagenet/val --dataset imagenet1k --precision fp32": "the released weights (1.2 GB) and ImageNet",
    "hf upload my-org/crate-alpha-clipa-demo exports/my_model .": "a Hugging Face account",
    "hf download UCSC-VLAA/ViT-H-14-CLIPA-datacomp1B": "the Hugging Face hub",
    "hf auth login": "a Hugging Face account",
    "pip install awscli": "a network install",
    "python -m build --outdir /tmp/crate_dist": "the wheel, by hand (docs/python_api.md): built in an isolated "
    "environment whose setuptools comes from PyPI; tests/test_wheel_contents.py builds it offline",
    "uv venv /tmp/wheelvenv": "a fresh environment for the wheel, by hand (docs/python_api.md)",
    "uv pip install --python /tmp/wheelvenv/bin/python /tmp/crate_dist/crate_clip-0.1.0-py3-none-any.whl "
    "torch==2.14.1 torchvision==0.29.1": "the wheel and its dependencies into a fresh environment (GBs), by hand",
    "pip install wandb": "a network install",
    "python bench/bench_patch_size.py": "a benchmark: three demo runs, ~15 min (BENCHMARKS.md)",
    "python bench/bench_token_strategies.py --widths w64 w256 --arms full resize-grow-4 random-4 --first-seed 1 "
    "--seeds 2":
        "a benchmark: twelve runs at two widths, ~60 min (tests/test_bench_token_strategies.py checks its arms' "
        "configs and tokens)",
    "python bench/bench_demo_recipe.py --seeds 0 1 2": "a benchmark: the demo and a full-resolution run of equal "
    "FLOPs a seed, ~15 min (tests/test_bench_demo_recipe.py checks the equal FLOPs and the summary)",
    "python bench/bench_text_tower.py --demo --data-dir /tmp/fmnist": "a benchmark: a full demo run per text tower",
    "python bench/bench_segmentation.py --train --write --figures": "a benchmark: trains two towers on the demo data",
}

# Inline names of an entry point (`crate-clip train` is `python -m crate_clip.train.cli`): not run; the module must
# exist.
ENTRY_POINTS = {"python -m crate_clip.train.cli", "python -m crate_clip.train.worker_launch",
                "python -m open_clip_train.main"}

# Modules a page runs with `python -m` that are a tool the reader installs for that one step, not a dependency of
# crate-clip, so absent from this environment (the command itself is in NOT_HERE): not looked for, with the reason.
OTHER_TOOLS = {"build": "PyPA's build, from PyPI: docs/python_api.md's wheel (tests/test_wheel_contents.py builds "
                        "it with pip wheel, offline)"}
