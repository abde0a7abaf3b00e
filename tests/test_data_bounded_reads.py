"""Bounded reading and sizes as facts, through the real `crate-clip shards inspect` (and `train --validate`) run as
subprocesses: compressed shards, oversized members, images, captions and samples are counted skips that cost no
memory; special files are refused at once; truncated and missing shards and malformed stats are reported, not
guessed; the shuffle buffer holds at most its byte bound."""
import gzip
import json
import os
import struct
import subprocess
import sys
import tarfile
import zlib
from pathlib import Path

import pytest

import warm_python
from data_fixtures import add_member, jpeg_bytes, write_tar
from train_fixtures import REPO_ROOT, run_env

CLI = [sys.executable, "-m", "crate_clip.data.cli", "inspect"]


def good_members(prefix: str, n: int) -> list[tuple[str, bytes]]:
    """n whole samples (a small JPEG and a caption each) keyed prefix0000i."""
    return [m for i in range(n)
            for m in ((f"{prefix}{i:04d}.jpg", jpeg_bytes()), (f"{prefix}{i:04d}.txt", b"a red box"))]


def png_16bit_gray(width: int, height: int) -> bytes:
    """A real, decodable 16-bit grayscale PNG of zeros: small on disk, width x height x 2 bytes decoded."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    row = b"\x00" * (1 + 2 * width)   # filter byte + the row's 16-bit samples
    packer = zlib.compressobj(9)
    idat = b"".join(packer.compress(row) for _ in range(height)) + packer.flush()
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 16, 0, 0, 0, 0))
            + chunk(b"IDAT", idat) + chunk(b"IEND", b""))


def gzip_tar_of_zeros(path: Path, member_bytes: int) -> None:
    """A gzip-compressed tar holding one member of zeros (a few hundred KB on disk)."""
    with gzip.open(path, "wb", compresslevel=1) as raw, tarfile.open(fileobj=raw, mode="w|") as tar:
        info = tarfile.TarInfo("00010000.jpg")
        info.size = member_bytes
        zeros = open("/dev/zero", "rb")
        tar.addfile(info, zeros)
        zeros.close()


def sparse_member_tar(path: Path, member_bytes: int) -> None:
    """A tar whose first member claims member_bytes (a hole on disk), then one whole sample and the end blocks."""
    with open(path, "wb") as f:
        info = tarfile.TarInfo("00020000.jpg")
        info.size = member_bytes
        f.write(info.tobuf(tarfile.USTAR_FORMAT))
        f.seek(member_bytes, os.SEEK_CUR)   # sparse: nothing written
        with tarfile.open(fileobj=f, mode="w|", format=tarfile.USTAR_FORMAT) as tar:
            for name, data in good_members("0007", 1):
                add_member(tar, name, data)


def sparse_sample_tar(path: Path, members: int, member_bytes: int) -> None:
    """A tar whose first sample has `members` members of member_bytes each (holes on disk: nothing written, each
    under the member cap), then one whole sample and the end blocks."""
    with open(path, "wb") as f:
        for i in range(members):
            info = tarfile.TarInfo(f"00080000.part{i:02d}")
            info.size = member_bytes
            f.write(info.tobuf(tarfile.USTAR_FORMAT))
            f.seek(-(-member_bytes // 512) * 512, os.SEEK_CUR)
        with tarfile.open(fileobj=f, mode="w|", format=tarfile.USTAR_FORMAT) as tar:
            for name, data in good_members("0010", 1):
                add_member(tar, name, data)


def size_field_tar(path: Path, size: int) -> None:
    """A tar of one member header whose base-256 size field says `size` (2^80: beyond any file), then end blocks."""
    header = bytearray(tarfile.TarInfo("00090000.jpg").tobuf(tarfile.USTAR_FORMAT))
    header[124:136] = b"\x80" + size.to_bytes(11, "big")   # GNU's base-256 number: the first byte's high bit set
    header[148:156] = b" " * 8
    header[148:156] = b"%06o\0 " % sum(header)   # the checksum of the edited header
    path.write_bytes(bytes(header) + bytes(1024))


@pytest.fixture(scope="module")
def shard_sets(tmp_path_factory):
    """clean/: one shard of 8 whole samples; bad/: the same shard plus a gzip shard with a 256 MiB member, a member
    header claiming 1 GiB, a 7000 x 7000 16-bit PNG and a 10 MB caption (each next to one whole sample)."""
    root = tmp_path_factory.mktemp("bounded")
    clean, bad = root / "clean", root / "bad"
    for d in (clean, bad):
        d.mkdir()
        write_tar(d / "00000000.tar", good_members("0000", 8))
    gzip_tar_of_zeros(bad / "00000001.tar", 256 << 20)
    sparse_member_tar(bad / "00000002.tar", 1 << 30)
    write_tar(bad / "00000003.tar", [("00030000.png", png_16bit_gray(7000, 7000)), ("00030000.txt", b"huge png")]
              + good_members("0006", 1))
    write_tar(bad / "00000004.tar", [("00040000.jpg", jpeg_bytes()), ("00040000.txt", b"word " * (2 << 20))]
              + good_members("0005", 1))
    return clean, bad


@pytest.fixture(scope="module")
def attack_shards(shard_sets, tmp_path_factory):
    """The clean shard beside the issue-50 attack's: one sample of 24 members of 60 MiB (each under the 64 MiB member
    cap: 1.4 GB together, which took +1.38 GB) and a member whose size field says 2^80 bytes."""
    attack = tmp_path_factory.mktemp("attack")
    (attack / "00000000.tar").symlink_to(shard_sets[0] / "00000000.tar")
    sparse_sample_tar(attack / "00000001.tar", 24, 60 << 20)
    size_field_tar(attack / "00000002.tar", 1 << 80)
    return attack


def inspect(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    """`crate-clip shards inspect ARGS` forked warm (the real command, its exit code and output)."""
    return warm_python.run(CLI + list(args), env=run_env(), cwd=REPO_ROOT, capture_output=True, text=True,
                           timeout=timeout)


EPOCH = ("--mode", "epoch", "--batches", "100", "--batch-size", "4")


def test_bad_members_are_counted_skips_and_the_rest_is_read(shard_sets):
    _, bad = shard_sets
    proc = inspect(str(bad), *EPOCH)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    skips = report["skip_counts"]
    assert (skips["compressed_shard"], skips["oversized_member"], skips["decompression_bomb"],
            skips["oversized_caption"]) == (1, 1, 1, 1)
    assert report["samples_read"] == 8 + 3   # the whole sample beside each bad one is read
    assert report["shard_sizes"]["compressed"] == {"count": 1, "first": [str(bad / "00000001.tar")]}
    assert "Traceback" not in proc.stderr


# Peak memory with the bad shards against without them, each command forked from the same warm interpreter (the
# zygote: torch, DeepSpeed and open_clip imported, ~0.7 GB of RSS shared with it), so both start from the same pages
# and the difference is what the bad shards cost. 64 MiB: below the smallest bad member decoded (the 7000 x 7000
# 16-bit PNG, 98 MB), far above two runs' noise (a few MiB).
EXTRA_PEAK_KB = 64 << 10


def _peaks_kb(runs) -> list[int]:
    """The peak RSS of each finished warm command (a fresh interpreter would have another baseline: refused)."""
    peaks = [done.max_rss_kb for done in runs]
    assert None not in peaks, "the commands must be forked from the warm interpreter to share one baseline"
    return peaks


@pytest.fixture(scope="module")
def clean_inspection(shard_sets) -> subprocess.CompletedProcess:
    """The real command on the clean shard alone, once: the baseline of the memory tests below."""
    proc = inspect(str(shard_sets[0]), *EPOCH)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc


@pytest.mark.slow   # two warm inspections: ~5 s of CPU
def test_peak_memory_with_bad_shards_adds_less_than_a_decoded_bad_member(shard_sets, clean_inspection):
    """The real command's peak RSS on the clean shard, then on it with the bad shards beside it."""
    proc = inspect(str(shard_sets[1]), *EPOCH)
    assert proc.returncode == 0, proc.stderr[-2000:]
    clean_kb, both_kb = _peaks_kb([clean_inspection, proc])
    assert both_kb - clean_kb <= EXTRA_PEAK_KB, f"peak RSS {clean_kb} KB without the bad shards, {both_kb} KB with"


def test_the_attack_shards_are_counted_within_a_tenth_of_a_clean_runs_memory(attack_shards, clean_inspection):
    """Issue 50's shards: the sample of 24 x 60 MiB is skipped once its members pass the sample budget (the first
    one, within it, is read: the 60 MiB this costs is inside the tenth), the one after it is read; the 2^80 size
    field is a malformed header, the shard named in the census line; peak RSS at most 1.1 x the clean run's."""
    proc = inspect(str(attack_shards), *EPOCH)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    assert (report["skip_counts"]["oversized_sample"], report["skip_counts"]["unreadable_shard"]) == (1, 1)
    assert report["samples_read"] == 8 + 1
    census = [line for line in proc.stderr.splitlines() if "shard sizes" in line]
    assert len(census) == 1 and f"1 unreadable (not tar files: count 0; first: {attack_shards}/00000002.tar)" \
        in census[0], proc.stderr
    clean_kb, attack_kb = _peaks_kb([clean_inspection, proc])
    assert attack_kb <= 1.1 * clean_kb, f"peak RSS {clean_kb} KB on the clean shard, {attack_kb} KB with the attack's"


def test_the_shuffle_buffer_holds_at_most_its_byte_bound_beside_one_sample():
    """bounded_shuffle gives webdataset's order while under its byte bound, and at the bound holds at most the bound
    plus the sample being added (samples of 1 to 50 KB, bound 200 KB): not shuffle_buffer x the sample budget."""
    import random

    import webdataset as wds

    from crate_clip.core.tar_samples import held_bytes
    from crate_clip.data.stream_slices import bounded_shuffle

    samples = [{"__key__": f"{i:04d}", "jpg": bytes(1000 * (1 + i * 7 % 50))} for i in range(600)]
    keys = [s["__key__"] for s in bounded_shuffle(iter(samples), 1000, 1 << 30, random.Random("t"))]
    assert keys == [s["__key__"] for s in wds.shuffle(1000, initial=100, rng=random.Random("t"))(iter(samples))]
    held, peak, bound = 0, 0, 200_000

    def source():
        nonlocal held, peak
        for sample in samples:
            held += held_bytes(sample)   # taken from the shards: in the buffer until it is yielded
            peak = max(peak, held)
            yield sample

    out = []
    for sample in bounded_shuffle(source(), 1000, bound, random.Random("t")):
        held -= held_bytes(sample)
        out.append(sample["__key__"])
    assert sorted(out) == [s["__key__"] for s in samples] and held == 0
    assert bound < peak <= bound + max(held_bytes(s) for s in samples), peak


@pytest.mark.slow   # two warm training runs: ~10 s of CPU
def test_a_training_runs_peak_memory_with_bad_shards_adds_less_than_a_decoded_bad_member(shard_sets, tmp_path):
    """The same for `crate-clip train` (4 steps, the reading in the trainer: num_workers 0) on the clean shard, then
    on it with the uncompressed bad shards beside it (a compressed shard is refused before training: test above)."""
    from train_fixtures import tiny_config, write_config

    clean, bad = shard_sets
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    for shard in sorted(bad.glob("*.tar")):
        if shard.name != "00000001.tar":   # the gzip one
            (mixed / shard.name).symlink_to(shard)
    stage = {"name": "s", "image_size": 16, "context_length": 16, "samples": 16, "global_batch": 4, "lr": 1e-3,
             "warmup_steps": 1}
    runs = []
    for name, data in (("clean", clean), ("mixed", mixed)):
        cfg = tiny_config(tmp_path / f"run-{name}", tmp_path, precision="fp32", stages=[dict(stage)], evals=False,
                          logging={"every_steps": 1, "progress": False, "tensorboard": False, "plot": False})
        cfg["data"].update(sources=[str(data)], num_workers=0, shuffle_buffer=4)
        config = write_config(cfg, tmp_path / f"{name}.yaml")
        runs.append(warm_python.run([sys.executable, "-m", "crate_clip.cli", "train", str(config)], env=run_env(),
                                    cwd=REPO_ROOT, capture_output=True, text=True, timeout=600))
        assert runs[-1].returncode == 0, runs[-1].stderr[-3000:]
    clean_kb, both_kb = _peaks_kb(runs)
    assert both_kb - clean_kb <= EXTRA_PEAK_KB, f"peak RSS {clean_kb} KB without the bad shards, {both_kb} KB with"
    skips = {}
    for line in (tmp_path / "run-mixed" / "metrics.jsonl").read_text().splitlines():
        skips.update(json.loads(line).get("data_skips") or {})
    assert all(skips.get(k) for k in ("oversized_member", "decompression_bomb", "oversized_caption")), skips


def test_caps_are_options_of_inspect(shard_sets):
    clean, _ = shard_sets
    proc = inspect(str(clean), *EPOCH, "--max-caption-bytes", "5", "--max-member-bytes", "100000")
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    assert report["samples_read"] == 0 and report["skip_counts"]["oversized_caption"] == 8   # "a red box": 9 bytes


@pytest.mark.parametrize("how", ["FIFO named", "FIFO in a folder", "link to /dev/zero in a folder"])
def test_a_special_file_shard_is_refused_at_once(tmp_path, how):
    special = tmp_path / "00000001.tar"
    write_tar(tmp_path / "00000000.tar", good_members("0000", 2))
    if how.startswith("FIFO"):
        os.mkfifo(special)
    else:
        special.symlink_to("/dev/zero")
    proc = inspect(str(special) if how == "FIFO named" else str(tmp_path), "--batches", "1", timeout=60)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    kind = "a FIFO" if how.startswith("FIFO") else "a character device"
    assert len(lines) == 1 and f"{kind}, not a regular file" in lines[0] and str(special) in lines[0]


def test_train_validate_refuses_a_fifo_and_a_gzip_shard(tmp_path):
    from train_fixtures import tiny_config, write_config

    fifo, gz = tmp_path / "fifo" / "train" / "00000000.tar", tmp_path / "gz" / "train" / "00000000.tar"
    fifo.parent.mkdir(parents=True)
    gz.parent.mkdir(parents=True)
    os.mkfifo(fifo)
    with gzip.open(gz, "wb") as raw, tarfile.open(fileobj=raw, mode="w|") as tar:
        add_member(tar, "00000000.txt", b"a caption")
    for shard, words in ((fifo, "is a FIFO, not a regular file"), (gz, "is a gzip-compressed tar")):
        config = write_config(tiny_config(tmp_path / "run", shard.parent.parent, evals=False), tmp_path / "c.yaml")
        proc = warm_python.run([sys.executable, "-m", "crate_clip.train.cli", "--config", str(config), "--validate"],
                               env=run_env(), cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2, proc.stderr[-2000:]
        problems = [line for line in proc.stderr.splitlines() if line.strip().startswith("data.sources")]
        assert len(problems) == 1 and words in problems[0] and str(shard) in problems[0], proc.stderr
        assert "Traceback" not in proc.stderr


def test_sizes_are_facts(tmp_path):
    """A truncated tar counts its whole samples before the cut, a missing shard counts 0 whatever its stats say,
    and img2dataset's own counts are reported."""
    write_tar(tmp_path / "00000000.tar", good_members("0000", 3))
    stats = {"count": 5, "successes": 3, "failed_to_download": 1, "failed_to_resize": 1, "status_dict": {}}
    (tmp_path / "00000000_stats.json").write_text(json.dumps(stats))
    whole = write_tar(tmp_path / "whole.tmp", good_members("0001", 4))
    with tarfile.open(whole) as tar:
        cut = tar.getmember("00010002.jpg").offset_data + 10   # in the third sample's image
    (tmp_path / "00000001.tar").write_bytes(whole.read_bytes()[:cut])
    whole.unlink()
    (tmp_path / "00000001_stats.json").write_text(json.dumps({**stats, "successes": 4}))
    (tmp_path / "00000002_stats.json").write_text(json.dumps({**stats, "successes": 7}))   # its tar is missing
    proc = inspect(str(tmp_path / "{00000000..00000002}.tar"), *EPOCH)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    sizes = report["shard_sizes"]
    assert report["num_samples"] == 3 + 2 == report["samples_read"]
    assert sizes["truncated"] == {"count": 1, "first": {str(tmp_path / "00000001.tar"): 2}}
    assert sizes["missing"] == {"count": 1, "first": [str(tmp_path / "00000002.tar")]}
    assert sizes["img2dataset"] == {"stats_files": 2, "count": 10, "successes": 7, "failed_to_download": 2,
                                    "failed_to_resize": 2}   # a missing tar's stats are not counted
    warnings = [line for line in proc.stderr.splitlines() if "shard sizes" in line]
    assert len(warnings) == 1 and "1 missing" in warnings[0] and "1 truncated" in warnings[0]


def test_malformed_stats_and_sizes_are_one_counted_warning(tmp_path):
    for s, successes in enumerate(("1e309", "-3", '"12"')):
        write_tar(tmp_path / f"0000000{s}.tar", good_members(f"000{s}", 2))
        (tmp_path / f"0000000{s}_stats.json").write_text('{"successes": %s}' % successes)
    (tmp_path / "sizes.json").write_text("[]")
    proc = inspect(str(tmp_path), *EPOCH)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    assert report["num_samples"] == 6 == report["samples_read"]   # counted from the tar headers
    malformed = report["shard_sizes"]["malformed"]
    assert malformed["count"] == 4 and any("sizes.json: a list" in m for m in malformed["first"])
    assert any("successes is Infinity" in m for m in malformed["first"])
    assert "Traceback" not in proc.stderr
    assert len([line for line in proc.stderr.splitlines() if "4 malformed" in line]) == 1


@pytest.mark.parametrize("fmt", [tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
def test_long_member_names_of_gnu_and_pax_tars_are_read(tmp_path, fmt):
    """The bounded reader parses the headers tarfile and GNU tar write for names above 100 characters."""
    from collections import Counter

    from crate_clip.data.shard_reader import iter_shard_samples

    key = "shards/" + "k" * 110 + "\u00e9"   # a last part above ustar's 100 characters, and not ASCII
    with tarfile.open(tmp_path / "long.tar", "w", format=fmt) as tar:
        for name, data in ((f"{key}.jpg", jpeg_bytes()), (f"{key}.txt", "caption \u00e9".encode())):
            add_member(tar, name, data)
    skips = Counter()
    samples = list(iter_shard_samples(str(tmp_path / "long.tar"), skips))
    assert [s["__key__"] for s in samples] == [key] and samples[0]["txt"] == "caption \u00e9".encode()
    assert sum(skips.values()) == 0


def test_a_pipe_stats_probe_reads_a_bounded_prefix(tmp_path):
    """A `pipe:` source's _stats.json is read through the shards' transport: a command printing without end is
    "size unknown" after at most MAX_STATS_BYTES + 1 bytes (it is killed, its output never held whole), and a
    well-formed one is read."""
    import resource

    from crate_clip.data.shard_census import MAX_STATS_BYTES, remote_shard_size

    (tmp_path / "a_stats.json").write_text(json.dumps({"successes": 7}))
    assert remote_shard_size(f"pipe:cat {tmp_path}/a.tar", timeout=30) == 7
    # `yes` never ends: its first MAX_STATS_BYTES + 1 bytes decide, then the command is killed
    endless = f"pipe:sh -c 'yes {'x' * 1000}; cat {tmp_path}/b.tar'"
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert remote_shard_size(endless, timeout=30) is None
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024
    assert grown < 4 * MAX_STATS_BYTES, grown
