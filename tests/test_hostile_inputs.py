"""Small hostile inputs to the real commands (issue 41, items 4-6): a 1 KB YAML alias chain, YAML errors and absurd
numbers in `--set`, control characters in a config key, an export whose timm tower is a 1.8-billion-parameter
architecture, a NaN preprocessing mean, weights linked to /dev/zero, FIFOs as configs. Each is refused in one line
with exit code 2, fast and within a small memory bound, and every file the user gave is still there as it was.
Issue 50's (a brace pattern of 10^9 names, a 16 MiB config of 8 million values, a gzip bomb and an nshards.txt of
999,999,999 among evaluation data, a safetensors header claiming 2e9 values, a 3 GiB results.jsonl) each cost at most
a tenth more memory than the same command's clean run.

Every command runs as a subprocess (forked warm by tests/warm_python.py) through a wrapper that resets the process's
peak resident memory (/proc/self/clear_refs) and reports how far it rose: the alias chain took 3.5 GB and growing,
the gigantic tower 8.2 GB, before these bounds.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import stat
import sys
import tarfile
from pathlib import Path

import pytest
import yaml

import warm_python
from eval_fixtures import CRATE_TINY, write_tiny_export
from file_snapshots import snapshot
from train_fixtures import REPO_ROOT, run_env

PEAK_BOUND = 200 << 20   # what a refusal may add to the process's peak memory (the imports are in the zygote)
LINE_BOUND = 300         # characters of any line of a refusal
# The command inside a wrapper: peak resident memory reset after the imports, its rise written to $PEAK_FILE.
WRAPPER = """
import os, sys
from crate_clip.cli import main
def status(field):
    return next(int(l.split()[1]) << 10 for l in open('/proc/self/status') if l.startswith(field))
with open('/proc/self/clear_refs', 'w') as f:
    f.write('5')
start = status('VmRSS:')
try:
    code = main(sys.argv[1:])
finally:
    open(os.environ['PEAK_FILE'], 'w').write(str(status('VmHWM:') - start))
sys.exit(code)
"""


def _run(tmp_path: Path, *argv: str, timeout: int = 120) -> tuple[int, list[str], int]:
    """(exit code, stderr lines, peak memory rise in bytes) of `crate-clip ARGV`."""
    peak_file = tmp_path / "peak"
    env = dict(run_env(), PEAK_FILE=str(peak_file))
    done = warm_python.run([sys.executable, "-c", WRAPPER, *argv], env=env, cwd=str(tmp_path), capture_output=True,
                           text=True, timeout=timeout)
    lines = [line for line in done.stderr.splitlines() if "real_accelerator" not in line]   # DeepSpeed's notice
    return done.returncode, lines, int(peak_file.read_text())


def _refusal(tmp_path: Path, *argv: str) -> tuple[str, int]:
    """The one line of a refusal (exit code 2, no traceback, no line over LINE_BOUND) and its peak memory rise."""
    code, lines, peak = _run(tmp_path, *argv)
    assert code == 2 and len(lines) == 1 and "Traceback" not in lines[0], (code, lines)
    assert len(lines[0].replace(str(tmp_path), "<tmp>")) <= LINE_BOUND, lines[0]   # the message, not the paths
    return lines[0], peak


# ---------------------------------------------------------------------------------------------- run configs
def _config(tmp_path: Path, text: str = "", data: bool = True) -> Path:
    """A valid tiny run config (one stage, one shard unless `data` is False) followed by `text`."""
    shard = tmp_path / "shards" / "00000000.tar"
    shard.parent.mkdir(exist_ok=True)
    if not shard.exists():
        with tarfile.open(shard, "w"):
            pass
    cfg = {"run": {"output_dir": str(tmp_path / "run")}, "model": {"name": CRATE_TINY},
           "stages": [{"name": "s", "image_size": 16, "context_length": 8, "samples": 4, "global_batch": 2}]}
    if data:
        cfg["data"] = {"sources": [str(shard.parent)]}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False) + text)
    return path


def _alias_chain(levels: int) -> str:
    """data.sources as a chain of anchors, each listing the one before ten times: 10^levels values."""
    lines = ["data:", "  sources:", "    - &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"    - &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def test_a_1kb_alias_chain_is_refused_in_one_line_before_it_expands(tmp_path):
    config = _config(tmp_path, _alias_chain(8), data=False)
    assert config.stat().st_size < 1024
    before = snapshot(config)
    line, peak = _refusal(tmp_path, "train", "--config", str(config), "--validate")
    assert line.startswith(f"crate-clip train: {config}: refused: its aliases expand to more than 1,000,000 values")
    assert peak < PEAK_BOUND, f"{peak / 2 ** 20:.0f} MiB"   # 10^8 values: gigabytes before
    assert snapshot(config) == before and not (tmp_path / "run").exists()


def test_a_chain_within_the_bound_gives_short_lines_naming_each_key(tmp_path):
    """10^5 values pass the alias bound: each wrong source is one line, its value shortened (3.2 MB before)."""
    code, lines, _ = _run(tmp_path, "train", "--config", str(_config(tmp_path, _alias_chain(5), data=False)), "--validate")
    assert code == 2 and lines[0].startswith("crate-clip train: invalid run config")
    assert [line.split(":")[0].strip() for line in lines[1:]] == [f"data.sources.{i}" for i in range(5)]
    assert all(len(line) <= LINE_BOUND and "expected a string" in line for line in lines[1:]), lines


@pytest.mark.parametrize("assignment, says", [
    ("run=[1", "--set run: not valid YAML: line 2, column 1: while parsing a flow sequence"),
    ("data.sources={a: *b}", "--set data.sources: not valid YAML: line 1, column 5: found undefined alias"),
    ("run=!!python/object/apply:os.system [echo pwned]", "--set run: not valid YAML: line 1, column 1: could not "
                                                         "determine a constructor for the tag"),
    ("stages.0.lr=1e309", "stages.0.lr: '1e309' is not a finite number"),
    ("stages.0.lr=.inf", "stages.0.lr: inf is not a finite number"),
    ("stages.0.min_lr=.nan", "stages.0.min_lr: nan is not a finite number"),
    ("run.seed=1e26", "run.seed: 1e+26 is out of range (a 64-bit integer is expected)"),
    ("run.seed=4294967296", "run.seed: must be <= 4294967295, got 4294967296"),
    ("stages.0.image_size=1000000000", "stages.0.image_size: must be <= 4096, got 1000000000"),
    ("model.pretrained=/dev/zero", "model.pretrained: '/dev/zero' is a character device, not a regular file"),
])
def test_every_set_problem_is_refused_at_validation_naming_its_key(tmp_path, assignment, says):
    config = _config(tmp_path)
    code, lines, _ = _run(tmp_path, "train", "--config", str(config), "--validate", "--set", assignment)
    assert code == 2 and "Traceback" not in "\n".join(lines), lines
    problem = lines[-1].strip()   # the YAML errors are the message; a bad value is the line under its config's
    assert problem.startswith(says) or problem.startswith(f"crate-clip train: {says}"), lines
    assert len(lines) <= 2 and all(len(line) <= LINE_BOUND for line in lines), lines


def test_control_characters_in_a_key_are_escaped_not_sent_to_the_terminal(tmp_path):
    config = _config(tmp_path, '"evil\\e]0;title\\a\\e[2J": 1\n')
    code, lines, _ = _run(tmp_path, "train", "--config", str(config), "--validate")
    assert code == 2 and lines[1].strip().startswith(r"evil\x1b]0;title\x07\x1b[2J: unknown key"), lines
    assert not any(ch in "\n".join(lines) for ch in "\x1b\x07")


def test_a_fifo_config_says_it_is_a_fifo_and_does_not_block(tmp_path):
    fifo = tmp_path / "run.yaml"
    os.mkfifo(fifo)   # nobody writes to it: a read would wait for ever
    line, _ = _refusal(tmp_path, "train", "--config", str(fifo), "--validate")
    assert line == f"crate-clip train: --config: {str(fifo)!r} is a FIFO, not a regular file"
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


def test_bounded_aliases_still_work(tmp_path):
    """Aliases are bounded, not refused: a config may share a stage's settings."""
    from crate_clip.train.run.run_config import load_run_config

    config = _config(tmp_path)
    shared = "stages:\n  - &base {name: a, image_size: 16, context_length: 8, samples: 4, global_batch: 2}\n" \
             "  - {<<: *base, name: b}\n"
    config.write_text(yaml.safe_dump({k: v for k, v in yaml.safe_load(config.read_text()).items() if k != "stages"})
                      + shared)
    cfg = load_run_config(config)
    assert [(s.name, s.image_size) for s in cfg.stages] == [("a", 16), ("b", 16)]


# ---------------------------------------------------------------------------------------------- model folders
@pytest.fixture(scope="module")
def tiny_export(tmp_path_factory):
    return write_tiny_export(tmp_path_factory.mktemp("export") / "export")


def _edit_config(export: Path, edit) -> None:
    config = json.loads((export / "open_clip_config.json").read_text())
    edit(config)
    (export / "open_clip_config.json").write_text(json.dumps(config))


def _crate_tower_beside_small_weights(export: Path) -> str:
    _edit_config(export, lambda c: c["model_cfg"]["vision_cfg"].update(
        timm_model_name="crate_alpha_clipa.w1024_d24_h16_p14_224", image_size=224, patch_size=14))
    return "its model has 256,028,417 parameters, more than the 3,959,169 values"   # 252.6M in the image tower


def _gigantic_tower(export: Path) -> str:
    _edit_config(export, lambda c: c["model_cfg"]["vision_cfg"].update(timm_model_name="vit_gigantic_patch14_clip_224"))
    return "its image tower vit_gigantic_patch14_clip_224 has 1,842,777,344 parameters, more than the"


def _nan_mean(export: Path) -> str:
    _edit_config(export, lambda c: c["preprocess_cfg"].update(mean=[math.nan, 0.45, 0.4]))
    return "its image preprocessing cannot be used: preprocess_cfg.mean is [nan, 0.45, 0.4], not one or three finite"


def _zero_std(export: Path) -> str:
    _edit_config(export, lambda c: c["preprocess_cfg"].update(std=0))
    return "preprocess_cfg.std is 0, not one or three finite numbers above 0"


def _weights_to_dev_zero(export: Path) -> str:
    weights = export / "open_clip_model.safetensors"
    weights.unlink()
    weights.symlink_to("/dev/zero")
    return "open_clip_model.safetensors: a character device (a link to /dev/zero), not a weights file"


def _fifo_config(export: Path) -> str:
    (export / "open_clip_config.json").unlink()
    os.mkfifo(export / "open_clip_config.json")
    return "open_clip_config.json: a FIFO, not a regular file"


def _eval(export: Path) -> list[str]:
    return ["eval", "zeroshot", "--model", f"local-dir:{export}", "--data", "unused", "--dataset", "fashion_mnist",
            "--device", "cpu", "--no-progress"]


def _inspect(export: Path) -> list[str]:
    return ["inspect", "text", "a photo of a bag", "--model", f"local-dir:{export}"]


@pytest.mark.parametrize("make, command", [(_gigantic_tower, _eval), (_gigantic_tower, _inspect), (_nan_mean, _eval),
                                           (_zero_std, _eval), (_weights_to_dev_zero, _eval), (_fifo_config, _eval),
                                           (_crate_tower_beside_small_weights, _eval)],
                         ids=["gigantic-eval", "gigantic-inspect", "nan-mean", "zero-std", "dev-zero", "fifo-config",
                              "crate-tower"])
def test_an_export_is_checked_before_anything_is_built(tiny_export, tmp_path, make, command):
    export = tmp_path / "export"
    shutil.copytree(tiny_export, export)
    says = make(export)
    before = snapshot(export)
    line, peak = _refusal(tmp_path, *command(export))
    prog = " ".join(command(export)[:2 if command is _inspect else 1])
    assert line.startswith(f"crate-clip {prog}: {export}/") and says in line, line
    assert peak < PEAK_BOUND, f"{peak / 2 ** 20:.0f} MiB"   # the gigantic tower: 8.2 GB before
    assert snapshot(export) == before


def test_a_weights_link_out_of_the_export_is_named(tiny_export, tmp_path):
    export, elsewhere = tmp_path / "export", tmp_path / "elsewhere.safetensors"
    shutil.copytree(tiny_export, export)
    (export / "open_clip_model.safetensors").rename(elsewhere)
    (export / "open_clip_model.safetensors").symlink_to(elsewhere)
    code, lines, _ = _run(tmp_path, *_eval(export))
    assert f"note: {export}/open_clip_model.safetensors is a link to {elsewhere}, outside the export folder " \
           f"{export}" in lines, lines
    assert code == 2 and lines[-1].startswith("crate-clip eval: ") and "unused" in lines[-1]   # loaded: data next
    assert elsewhere.is_file() and (export / "open_clip_model.safetensors").is_symlink()


# ---------------------------------------------------------------------------------------------- weights files
def _fifo(path: Path) -> str:
    os.mkfifo(path)
    return "a FIFO"


def _socket(path: Path) -> str:
    import socket

    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(path))   # the socket file stays after the close
    return "a socket"


def _dev_zero_link(path: Path) -> str:
    path.symlink_to("/dev/zero")
    return "a character device (a link to /dev/zero)"


@pytest.mark.parametrize("make", [_fifo, _socket, _dev_zero_link])
def test_a_special_file_as_weights_says_what_it_is(tmp_path, make):
    weights = tmp_path / "weights.pt"
    kind = make(weights)
    line, _ = _refusal(tmp_path, "eval", "zeroshot", "--model", CRATE_TINY, "--pretrained", str(weights), "--data",
                       "unused", "--dataset", "fashion_mnist", "--device", "cpu", "--no-progress")
    assert line == f"crate-clip eval: {weights}: {kind}, not a weights file; fix: point to the weights file itself"
    assert os.path.lexists(weights)


@pytest.mark.parametrize("make", [_fifo, _dev_zero_link])
def test_a_special_file_given_to_export_says_what_it_is_and_writes_nothing(tmp_path, make):
    checkpoint = tmp_path / "checkpoint"
    kind = make(checkpoint)
    line, _ = _refusal(tmp_path, "export", str(checkpoint), "--out", str(tmp_path / "export"))
    assert line.startswith(f"crate-clip export: {checkpoint}: {kind}, not a folder (a run folder"), line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint", "peak"]


def test_a_run_folder_record_with_an_alias_chain_is_refused_in_one_line(tmp_path):
    """The run_config.yaml a resume compares against is read through the same bounds (a run folder from elsewhere)."""
    from crate_clip.core.errors import ConfigError
    from crate_clip.train.checkpointing.config_changes import recorded_config

    record = tmp_path / "run_config.yaml"
    record.write_text(_alias_chain(8))
    with pytest.raises(ConfigError) as refused:
        recorded_config(tmp_path)
    assert str(refused.value).startswith(f"{record}: refused: its aliases expand to more than 1,000,000 values")
    assert "\n" not in str(refused.value) and record.read_text() == _alias_chain(8)


# ---------------------------------------------------------------------------------------- issue 50: bounds that hold
RATIO = 1.1   # an attack input's peak RSS against its command's clean run


def _warm(cwd: Path, *argv: str) -> tuple[int, list[str], int]:
    """(exit code, stderr lines, peak RSS in KB) of `crate-clip ARGV` forked from the warm interpreter: two such
    commands share its pages, so their peaks compare (tests/README.md)."""
    done = warm_python.run([sys.executable, "-m", "crate_clip.cli", *argv], env=run_env(), cwd=str(cwd),
                           capture_output=True, text=True, timeout=300)
    assert done.max_rss_kb is not None, "forked from the warm interpreter, to share one baseline"
    return done.returncode, [line for line in done.stderr.splitlines() if "real_accelerator" not in line], \
        done.max_rss_kb


BILLION = "{0..999999999}"
TOO_MANY = "names {:,} shards, more than the 2,000,000 a data set may name (DataComp's largest pool: 1.28M); " \
           "fix: correct the pattern or count"


def test_a_billion_shard_pattern_and_a_config_of_millions_of_values_are_refused_before_expansion(tmp_path):
    """`train --validate`: a brace pattern of 10^9 names (local, http://, pipe:) is counted, not expanded (4.9 GB and
    a MemoryError before); a 16 MiB config of 8 million values is refused from the parser's events before any node
    exists (8.3 GB and 5 minutes before). Peak RSS within a tenth of the valid config's validation."""
    config = _config(tmp_path)
    code, lines, clean_kb = _warm(tmp_path, "train", "--config", str(config), "--validate")
    assert code == 0, lines
    for source in (f"{tmp_path}/shards/{BILLION}.tar", f"http://127.0.0.1:9/{BILLION}.tar", f"pipe:cat {BILLION}.tar"):
        code, lines, peak_kb = _warm(tmp_path, "train", "--config", str(config), "--validate", "--set",
                                     f"data.sources=[{source!r}]")
        assert code == 2 and lines[0] == f"crate-clip train: invalid run config ({config}):", lines
        assert lines[1:] == [f"  data.sources.0: source {source!r} {TOO_MANY.format(10 ** 9)}"], lines
        assert peak_kb <= RATIO * clean_kb, (source, clean_kb, peak_kb)
    huge = tmp_path / "huge.yaml"   # 16 MiB less a little: within the file-size bound, so the parser meets it
    huge.write_text(config.read_text() + "notes: [" + "0," * ((8 << 20) - 200) + "0]\n")
    code, lines, peak_kb = _warm(tmp_path, "train", "--config", str(huge), "--validate")
    at = len(config.read_text().splitlines()) + 1   # the line of the list
    assert code == 2 and lines == [f"crate-clip train: {huge}: refused: it holds more than 250,000 values (line {at}); "
                                   "fix: list the shards as a brace pattern or a folder"], lines
    # the bounded reader holds the file itself (its bytes and its text: 2 x 16 MiB), nothing of what it would build
    allowed_kb = RATIO * clean_kb + 2 * huge.stat().st_size / 1024
    assert peak_kb <= allowed_kb, (clean_kb, peak_kb, allowed_kb)


def _cls_shard(path: Path) -> Path:
    """A classification shard of two images of label 3 (`.jpg` + `.cls`)."""
    from data_fixtures import jpeg_bytes, write_tar

    path.parent.mkdir(parents=True, exist_ok=True)
    return write_tar(path, [m for i in range(2) for m in ((f"{i:05d}.jpg", jpeg_bytes()), (f"{i:05d}.cls", b"3"))])


def _gzip_bomb(path: Path, member_bytes: int = 1 << 30) -> Path:
    """A gzip "tar" of ~1 MB holding one member of member_bytes zeros: gzip members of 1 MiB of zeros repeated
    (a gzip stream may be several members), nothing compressed but the first MiB."""
    import gzip

    info = tarfile.TarInfo("00010000.jpg")
    info.size = member_bytes
    zeros = gzip.compress(bytes(1 << 20), compresslevel=9)
    with open(path, "wb") as f:
        f.write(gzip.compress(info.tobuf(tarfile.USTAR_FORMAT)))
        f.writelines([zeros] * (member_bytes >> 20))
    return path


def _header_claiming_2e9_values(export: Path) -> Path:
    """The export with a 303M-parameter timm tower (ViT-L/16), no recorded checksums, and weights whose safetensors
    header adds a tensor of 2e9 values the file does not hold: the tower check passed (2e9 > 303M) and the tower was
    built before the weights failed."""
    import struct

    def edit(config):
        config["model_cfg"]["vision_cfg"].update(timm_model_name="vit_large_patch16_224")
        config.pop("file_checksums", None)
    _edit_config(export, edit)
    weights = export / "open_clip_model.safetensors"
    raw = weights.read_bytes()
    length = struct.unpack("<Q", raw[:8])[0]
    header, data = json.loads(raw[8:8 + length]), raw[8 + length:]
    end = len(data) + 8_000_000_000   # 2e9 float32 values past the data the file holds
    header["visual.claimed"] = {"dtype": "F32", "shape": [2_000_000_000], "data_offsets": [len(data), end]}
    text = json.dumps(header).encode()
    weights.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return weights


def _eval_on(export: Path, data) -> list[str]:
    return ["eval", "zeroshot", "--model", f"local-dir:{export}", "--data", str(data), "--dataset", "fashion_mnist",
            "--device", "cpu", "--no-progress"]


def test_evaluation_data_and_weights_attacks_cost_at_most_a_tenth_more_than_a_clean_run(tiny_export, tmp_path):
    """`eval zeroshot` reads its shards with the training stream's bounded reader: a 1 MB gzip "tar" with a 1 GiB
    member is an unreadable shard named as compressed (+2 GB and "truncated" before); an nshards.txt of 999,999,999
    and a brace pattern of 10^9 names are one line naming the file or pattern; a safetensors header claiming 2e9
    values is refused before the 303M tower is built. Peak RSS within a tenth of a clean evaluation's."""
    clean = _cls_shard(tmp_path / "clean" / "00000000.tar").parent
    code, lines, clean_kb = _warm(tmp_path, *_eval_on(tiny_export, clean))
    assert code == 0, lines
    bomb = tmp_path / "bomb"
    _cls_shard(bomb / "00000000.tar")
    _gzip_bomb(bomb / "00000001.tar")
    nshards = tmp_path / "wds" / "test" / "nshards.txt"
    nshards.parent.mkdir(parents=True)
    nshards.write_text("999999999\n")
    export = tmp_path / "export"
    shutil.copytree(tiny_export, export)
    weights = _header_claiming_2e9_values(export)
    cases = [(_eval_on(tiny_export, bomb), f"{bomb / '00000001.tar'}: unreadable tar (CompressedTarError: "
                                           "gzip-compressed tar: crate-clip reads uncompressed .tar shards only)"),
             (_eval_on(tiny_export, nshards.parent.parent), f"crate-clip eval: {nshards} {TOO_MANY.format(999999999)}"),
             (_eval_on(tiny_export, f"{clean}/{BILLION}.tar"),
              f"crate-clip eval: source '{clean}/{BILLION}.tar' {TOO_MANY.format(10 ** 9)}"),
             (_eval_on(export, clean), f"crate-clip eval: {weights}: its header claims tensor 'visual.claimed' of "
                                       f"2,000,000,000 values at bytes ")]
    for argv, says in cases:
        code, lines, peak_kb = _warm(tmp_path, *argv)
        assert code == 2 and len(lines) == 1 and says in lines[0] and "Traceback" not in lines[0], lines
        assert peak_kb <= RATIO * clean_kb, (says, clean_kb, peak_kb)


def test_export_reads_results_jsonl_bounded_and_refuses_a_malformed_row(tmp_path):
    """A 3 GiB results.jsonl (sparse) is refused from its size (7.25 GB before), a row `5` in one line naming its
    line (an AttributeError before), both before any weights are read; peak RSS within a tenth of the export of the
    same checkpoint with a valid results.jsonl (which goes on to its weights: here none, an error after the read)."""
    from crate_clip.checkpoint_io.checkpoint_record import INFO_FILE, CheckpointInfo, Progress

    tag = tmp_path / "run" / "checkpoints" / "stage0-step00000004"
    tag.mkdir(parents=True)
    record = CheckpointInfo(CRATE_TINY, 28, 32, 4, 0, "s", 4, "fp32", {}, {"mean": [0.5] * 3, "std": [0.5] * 3}, {},
                            Progress(stage_index=0, step=4, global_step=4))
    (tag / INFO_FILE).write_text(json.dumps(record.as_dict()))
    results = tmp_path / "run" / "results.jsonl"
    row = json.dumps({"stage_index": 0, "eval": "fmnist", "image_size": 28, "top1": 0.5})
    export = ["export", str(tag), "--out", str(tmp_path / "out")]
    results.write_text(row + "\n")
    code, lines, clean_kb = _warm(tmp_path, *export)
    assert code == 2 and "mp_rank_00_model_states.pt" in lines[-1], lines   # past the results: the weights
    results.write_text(f"{row}\n5\n")
    code, lines, row_kb = _warm(tmp_path, *export)
    assert code == 2 and lines == [f"crate-clip export: {results}:2: 5 is not a JSON object: not a result row the "
                                   "trainer writes; fix: remove the line (or move the file away: the card then lists "
                                   "no results)"], lines
    with open(results, "wb") as f:
        f.truncate(3 << 30)   # sparse: 3 GiB of size, no disk used
    code, lines, huge_kb = _warm(tmp_path, *export)
    assert code == 2 and lines == [f"crate-clip export: {results}: 3,221,225,472 bytes, more than the 67,108,864 such "
                                   "a file may hold; the model card lists the run's results from it"], lines
    assert max(row_kb, huge_kb) <= RATIO * clean_kb, (clean_kb, row_kb, huge_kb)
    assert not (tmp_path / "out").exists()
