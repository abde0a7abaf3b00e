"""Reliability of the data layer: decompression bombs, missing sources, lazy sizes, real epoch counts."""
import json
import struct
import zlib

import pytest

from crate_clip.data.image_decode import BadImage, open_image

from data_fixtures import jpeg_bytes, write_tar


def png_header(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height pixels (no pixel data: opening reads the header only)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)) + \
        chunk(b"IEND", b"")


def test_image_above_pils_own_limit_is_a_decompression_bomb():
    huge = png_header(20_000, 10_000)   # 200 MP: above PIL's 2 x 89.5 MP error threshold
    with pytest.raises(BadImage) as err:
        open_image(huge)
    assert err.value.reason == "decompression_bomb"


def test_max_image_pixels_above_pils_default_is_honoured():
    huge = png_header(20_000, 10_000)
    assert open_image(huge, max_pixels=300_000_000).size == (20_000, 10_000)
    with pytest.raises(BadImage) as err:
        open_image(huge, max_pixels=150_000_000)
    assert err.value.reason == "decompression_bomb" and "max_image_pixels=150000000" in str(err.value)


def test_shards_inspect_says_a_missing_path_is_missing(capsys):
    from crate_clip.data.cli import main

    assert main(["inspect", "/missing/path", "--batches", "1"]) == 2
    err = capsys.readouterr().err
    assert "/missing/path" in err and "does not exist" in err and "Traceback" not in err


@pytest.fixture(scope="module")
def four_shards(tmp_path_factory):
    """4 shards x 3 good samples, each with an img2dataset-style _stats.json."""
    d = tmp_path_factory.mktemp("four")
    for s in range(4):
        write_tar(d / f"{s:08d}.tar", [m for i in range(3) for m in
                                       ((f"{s}{i:05d}.jpg", jpeg_bytes()), (f"{s}{i:05d}.txt", b"a caption"))])
        (d / f"{s:08d}_stats.json").write_text(json.dumps({"successes": 3}))
    return d


def test_resampled_stream_reads_no_stats_file_until_its_size_is_asked(four_shards, monkeypatch):
    import crate_clip.data.train_stream as train_stream
    from crate_clip.data.train_stream import StreamConfig, build_train_stream

    calls = []
    real = train_stream.resolve_sizes
    monkeypatch.setattr(train_stream, "resolve_sizes", lambda shards: calls.append(len(shards)) or real(shards))
    stream = build_train_stream(StreamConfig(sources=[str(four_shards)], num_workers=0, shuffle_buffer=4), image_size=16,
                                context_length=8, text_mask="truncate", batch_size=2)
    next(iter(stream))
    assert calls == []          # a stage start of the trainer reads no _stats.json
    assert stream.num_samples == 12 and calls == [4]


def ranks_2(*args: str, timeout: int = 180):
    """Run tests/reliability_workers.py on 2 gloo ranks, forked from a warm interpreter (train_fixtures.ranks_cmd's
    launcher, tests/fork_ranks.py: torchrun's environment); the completed process."""
    from pathlib import Path

    from train_fixtures import ranks_cmd, run_job

    return run_job(ranks_cmd(2, *args, script=Path(__file__).with_name("reliability_workers.py")), timeout=timeout)


@pytest.mark.slow
def test_epoch_length_follows_the_real_sample_count(tmp_path):
    """_stats.json claims 5 samples per shard, 3 are usable: the second epoch yields each sample once."""
    d = tmp_path / "overclaimed"
    d.mkdir()
    for s in range(4):
        members = [m for i in range(3) for m in ((f"{s}{i:05d}.jpg", jpeg_bytes()), (f"{s}{i:05d}.txt",
                                                                                   f"shard {s} sample {i}".encode()))]
        members += [(f"{s}{i:05d}.jpg", b"not an image") for i in range(3, 5)]   # counted as successes anyway
        write_tar(d / f"{s:08d}.tar", members)
        (d / f"{s:08d}_stats.json").write_text(json.dumps({"successes": 5}))
    proc = ranks_2("epoch-sizes", str(d), str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"out.{r}.json").read_text()) for r in range(2)]
    assert [r["batches_per_epoch"] for r in ranks] == [3, 3]    # 6 usable samples per rank, batch 2
    second = [tuple(row) for r in ranks for row in r["second"]]
    assert len(second) == 12 and len(set(second)) == 12        # every usable sample once, none wrapped
    assert "claimed 20 samples, 12 were usable" in proc.stderr


def test_shards_inspect_prints_samples_read_next_to_the_claimed_size(tmp_path, capsys):
    from crate_clip.data.cli import main

    d = tmp_path / "shards"
    d.mkdir()
    write_tar(d / "00000000.tar", [m for i in range(5) for m in ((f"{i:05d}.jpg", jpeg_bytes() if i < 3 else b"bad"),
                                                                 (f"{i:05d}.txt", b"a caption"))])
    (d / "00000000_stats.json").write_text(json.dumps({"successes": 5}))
    assert main(["inspect", str(d), "--mode", "epoch", "--batches", "100", "--batch-size", "2"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["num_samples"], report["samples_read"]) == (5, 3)


@pytest.mark.slow
def test_a_data_error_on_one_rank_stops_every_rank_with_its_message(tmp_path):
    proc = ranks_2("agreement", str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"out.{r}.json").read_text()) for r in range(2)]
    for r in ranks:   # eval lock-step loop and training batch fetch: both ranks stop, with rank 1's message
        assert "00000003.tar:000000000042 has no .cls member" in r["eval"]
        assert "00000003.tar:000000000042 has no .cls member" in r["train"]
    assert "rank 1" in ranks[0]["eval"] and "rank 1" in ranks[0]["train"]
