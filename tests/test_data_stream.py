"""The training stream: batches, bad data counted by reason, determinism, exact resume, rank/worker splits."""
import io
import json
import tarfile

import numpy as np
import pytest
import torch
from PIL import Image

from crate_clip.data.image_decode import decode_eval, decode_train, to_rgb
from crate_clip.data.shard_writer import encode_jpeg
from crate_clip.core.image_normalization import OPENAI_MEAN, OPENAI_STD
from crate_clip.data.train_stream import StreamConfig, build_train_stream

from data_fixtures import jpeg_bytes, write_numbered_shards, write_tar

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def numbered(tmp_path_factory, fashion_mnist_dir):
    """8 shards x 12 numbered Fashion-MNIST samples (captions identify samples)."""
    out = tmp_path_factory.mktemp("numbered")
    write_numbered_shards(out, 96, 12, fashion_mnist_dir)
    return out


def stream_of(src, **kw):
    """A stream with small defaults for tests."""
    build = {k: kw.pop(k) for k in ("image_size", "context_length", "text_mask", "batch_size", "rank",
                                    "world_size", "epoch") if k in kw}
    cfg = StreamConfig(sources=src if isinstance(src, list) else [str(src)], **{"shuffle_buffer": 20, **kw})
    args = {"image_size": 28, "context_length": 16, "text_mask": "truncate", "batch_size": 8, **build}
    return build_train_stream(cfg, **args)


def take(stream, n):
    """The first n batches of a stream."""
    out = []
    for batch in stream:
        out.append(batch)
        if len(out) == n:
            break
    return out


def test_batches_shapes_sizes_and_normalisation(numbered):
    stream = stream_of(numbered, num_workers=0)
    assert stream.num_samples == 96  # from the _stats.json files, no --train-num-samples needed
    (images, tokens), = take(stream, 1)
    assert images.shape == (8, 3, 28, 28) and images.dtype == torch.float32
    assert tokens.shape == (8, 16) and tokens.dtype == torch.int64
    assert (tokens[:, 0] == 49406).all() and ((tokens == 49407).sum(1) == 1).all()
    # Fashion-MNIST is gray: made RGB, so the three channels carry the same 0-255 values.
    raw = images * torch.tensor(OPENAI_STD).view(1, 3, 1, 1) + torch.tensor(OPENAI_MEAN).view(1, 3, 1, 1)
    assert torch.allclose(raw[:, 0], raw[:, 1], atol=1e-5) and 0 <= raw.min() and raw.max() <= 1 + 1e-5
    assert stream_of(numbered, num_workers=0, num_samples=5000).num_samples == 5000


@pytest.mark.parametrize("context_length", [8, 16, 32])
def test_context_lengths(numbered, context_length):
    (images, tokens), = take(stream_of(numbered, num_workers=0, context_length=context_length,
                                       text_mask="syntax"), 1)
    assert tokens.shape == (8, context_length)
    eot = (tokens == 49407).float().argmax(1)
    assert ((tokens == 49407).sum(1) == 1).all() and (eot <= context_length - 1).all()
    if context_length == 8:
        assert (eot == 7).all()  # every caption is longer than 6 tokens: reduced to exactly 6


def test_sizes_json_and_header_count(tmp_path):
    write_tar(tmp_path / "a.tar", [(f"{i:04d}.{ext}", jpeg_bytes() if ext == "jpg" else b"cap")
                                   for i in range(5) for ext in ("jpg", "txt")])
    assert stream_of(tmp_path, num_workers=0).num_samples == 5  # no stats: counted from tar headers
    (tmp_path / "sizes.json").write_text(json.dumps({"a.tar": 4}))
    assert stream_of(tmp_path, num_workers=0).num_samples == 4


@pytest.fixture(scope="module")
def corrupt_dir(tmp_path_factory):
    """Shards with one of each kind of bad data, plus 8 good samples in all."""
    d = tmp_path_factory.mktemp("corrupt")
    good = [(f"{i:012d}", jpeg_bytes(color=(20 * i, 100, 50))) for i in range(6)]
    members = []
    for key, jpg in good[:3]:
        members += [(f"{key}.jpg", jpg), (f"{key}.txt", f"good sample {key}".encode())]
    members += [("000000000100.jpg", b"\xff\xd8 garbage, not a jpeg"), ("000000000100.txt", b"garbage image")]
    members += [("000000000101.jpg", good[0][1])]                                       # missing caption
    members += [("000000000102.jpg", good[0][1]), ("000000000102.txt", b"  \n ")]       # empty caption
    members += [("000000000103.jpg", good[0][1]), ("000000000103.txt", b"caf\xe9 \xff")]  # not UTF-8
    members += [("000000000104.jpg", b""), ("000000000104.txt", b"zero bytes")]         # zero-size image
    bomb = encode_jpeg(Image.new("RGB", (1200, 1000), (1, 2, 3)), max_side=None)[0]
    members += [("000000000105.jpg", bomb), ("000000000105.txt", b"too many pixels")]
    members += [("000000000106.txt", b"caption without image")]                          # missing image
    for key, jpg in good[3:]:
        members += [(f"{key}.jpg", jpg), (f"{key}.txt", f"good sample {key}".encode())]
    members += [(f"{good[1][0]}.jpg", good[1][1]), (f"{good[1][0]}.txt", b"same key again")]  # duplicate key
    write_tar(d / "00000000.tar", members)
    # A tar cut off in the middle of its third sample's image.
    whole = write_tar(d / "whole.tmp", [(f"{i:012d}.{ext}", jpeg_bytes(color=(9, 9, 9)) if ext == "jpg" else b"cut")
                                        for i in range(200, 204) for ext in ("jpg", "txt")])
    with tarfile.open(whole) as tar:
        cut = tar.getmember("000000000202.jpg").offset_data + 100
    (d / "00000001.tar").write_bytes(whole.read_bytes()[:cut])
    whole.unlink()
    (d / "00000002.tar").write_bytes(b"this is not a tar file at all\n" * 40)
    return d


EXPECTED_SKIPS = {"truncated_tar": 1, "unreadable_shard": 2, "undecodable_image": 1, "zero_size_image": 1,
                  "decompression_bomb": 1, "missing_image": 1, "missing_caption": 1, "empty_caption": 1,
                  "non_utf8_caption": 1, "duplicate_key": 1, "compressed_shard": 0, "oversized_member": 0,
                  "oversized_caption": 0, "oversized_sample": 0}


@pytest.mark.parametrize("num_workers", [0, 2])
def test_bad_data_is_skipped_and_counted(corrupt_dir, num_workers):
    sources = [str(corrupt_dir), str(corrupt_dir / "00000009.tar")]  # the second one does not exist
    stream = stream_of(sources, mode="epoch", drop_last=False, num_workers=num_workers, num_samples=10,
                       max_image_pixels=1_000_000, batch_size=1, shards_per_group=1)
    captions = [tokens for _, tokens in stream]
    assert len(captions) == 3 + 3 + 2  # 6 good in the first tar, 2 before the cut in the truncated one
    assert stream.skip_counts() == EXPECTED_SKIPS


def test_skip_counts_survive_a_resume(corrupt_dir):
    kw = dict(mode="epoch", drop_last=False, num_workers=0, num_samples=10, max_image_pixels=1_000_000,
              batch_size=1, shards_per_group=3)
    first = stream_of(corrupt_dir, **kw)
    got = len(take(first, 4))
    resumed = stream_of(corrupt_dir, **kw)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    got += len(list(resumed))
    assert got == 8 and resumed.skip_counts() == {**EXPECTED_SKIPS, "unreadable_shard": 1}


def test_resampled_mode_is_deterministic(numbered):
    first = take(stream_of(numbered, num_workers=2, seed=3), 6)
    again = take(stream_of(numbered, num_workers=2, seed=3), 6)
    other = take(stream_of(numbered, num_workers=2, seed=4), 6)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(first, again))
    assert not all(torch.equal(a[1], b[1]) for a, b in zip(first, other))
    assert len({tuple(r) for _, t in first for r in t.tolist()}) > 12  # more than one shard's samples


def test_resampled_resume_is_exact(numbered):
    reference = take(stream_of(numbered, num_workers=2, text_mask="random", context_length=8), 14)
    interrupted = stream_of(numbered, num_workers=2, text_mask="random", context_length=8)
    take(interrupted, 5)
    state = json.loads(json.dumps(interrupted.state_dict()))  # must survive a JSON round trip
    assert state["batches"] == 5 and state["samples"] == 40
    resumed = stream_of(numbered, num_workers=2, text_mask="random", context_length=8)
    resumed.load_state_dict(state)
    for (ri, rt), (i, t) in zip(reference[5:], take(resumed, 9)):
        assert torch.equal(ri, i) and torch.equal(rt, t)
    with pytest.raises(ValueError, match="seed"):
        stream_of(numbered, num_workers=2, seed=9).load_state_dict(state)


def token_rows(batches):
    """Every token row of a list of batches, as tuples."""
    return [tuple(r) for _, t in batches for r in t.tolist()]


def test_epoch_mode_ranks_and_workers_disjoint_and_cover(numbered):
    everything = token_rows(stream_of(numbered, mode="epoch", num_workers=0, drop_last=False, batch_size=4))
    assert len(everything) == 96 and len(set(everything)) == 96
    per_rank = []
    for rank in range(2):
        stream = stream_of(numbered, mode="epoch", num_workers=2, drop_last=False, batch_size=4,
                           rank=rank, world_size=2)
        assert stream.batches_per_epoch == 12
        per_rank.append(token_rows(list(stream)))
    assert len(per_rank[0]) == len(per_rank[1]) == 48
    assert not set(per_rank[0]) & set(per_rank[1])
    assert set(per_rank[0]) | set(per_rank[1]) == set(everything)


def test_epoch_resume_neither_repeats_nor_skips(numbered):
    stream = stream_of(numbered, mode="epoch", num_workers=2, batch_size=4)
    first = token_rows(take(stream, 7))
    resumed = stream_of(numbered, mode="epoch", num_workers=2, batch_size=4)
    resumed.load_state_dict(stream.state_dict())
    rest = token_rows(list(resumed))
    assert len(first) + len(rest) == 96 and set(first) | set(rest) == set(token_rows(
        stream_of(numbered, mode="epoch", num_workers=0, batch_size=4)))
    assert resumed.epoch == 1  # the pass finished: the next __iter__ is the next epoch


def test_rank_without_shard(numbered, tmp_path):
    write_tar(tmp_path / "one.tar", [(f"{i:04d}.{e}", jpeg_bytes() if e == "jpg" else b"a red box")
                                     for i in range(6) for e in ("jpg", "txt")])
    with pytest.raises(ValueError, match="resampled"):
        stream_of(str(tmp_path / "one.tar"), mode="epoch", rank=1, world_size=2, num_workers=0)
    # Resampled: every rank and worker draws from all shards, so a single shard feeds 2 ranks x 2 workers.
    batches = take(stream_of(str(tmp_path / "one.tar"), rank=1, world_size=2, num_workers=2, batch_size=4), 4)
    assert len(batches) == 4 and all(b[0].shape[0] == 4 for b in batches)


def test_only_unreadable_shards_fail_instead_of_spinning(tmp_path):
    """Every shard unreadable (or a `pipe:true` that sends nothing): one line naming the shards and the fix, exit code
    2 after a save (not a traceback), also from a DataLoader worker."""
    from crate_clip.core.errors import report_error
    from crate_clip.data.stream_slices import NoUsableSamples

    (tmp_path / "00000000.tar").write_bytes(b"not a tar\n" * 10)
    for source, workers in ((tmp_path, 0), ("pipe:true", 1)):
        with pytest.raises(NoUsableSamples, match="without one usable sample") as err:
            take(stream_of(source, num_workers=workers, num_samples=10), 1)
        line = str(err.value)
        assert "\n" not in line and "Traceback" not in line and "crate-clip shards inspect" in line, line
        assert (str(tmp_path / "00000000.tar") if workers == 0 else "pipe:true") in line
        assert err.value.checkpoint_before_exit and report_error("crate-clip train", err.value) == 2


def test_every_image_mode_becomes_rgb():
    white = (255, 255, 255)
    assert to_rgb(Image.new("RGBA", (4, 4), (0, 0, 0, 0))).getpixel((1, 1)) == white
    assert to_rgb(Image.new("LA", (4, 4), (0, 0))).getpixel((1, 1)) == white
    pal = Image.new("P", (4, 4), 3)
    pal.info["transparency"] = 3
    assert to_rgb(pal).getpixel((0, 0)) == white
    assert to_rgb(Image.new("L", (4, 4), 77)).getpixel((0, 0)) == (77, 77, 77)
    assert to_rgb(Image.new("CMYK", (4, 4), (0, 0, 0, 0))).mode == "RGB"
    for mode in ("RGBA", "P", "L", "I;16"):
        buf = io.BytesIO()
        Image.new(mode, (30, 20)).save(buf, format="PNG")
        assert decode_eval(buf.getvalue(), 16).shape == (16, 16, 3)
    # Eval transform: shorter side to 16, centre crop; a left-black / right-white image keeps its middle.
    from crate_clip.data.image_decode import EvalTransform

    half = Image.new("L", (64, 32), 0)
    half.paste(255, (32, 0, 64, 32))
    x = EvalTransform(16, (0, 0, 0), (1, 1, 1))(half)
    # exact: the 2x bicubic shrink reads source pixels within +-4 of an output pixel's centre, so output columns
    # 0-5 see only black and 10-15 only white (columns 6-9 straddle the edge at source column 32)
    assert x.shape == (3, 16, 16) and (x[:, :, :6] == 0).all() and (x[:, :, 10:] == 1).all()


def test_reduced_size_jpeg_decode_matches_full_decode(fashion_mnist_dir):
    from crate_clip.data.sources.fashion_mnist import load_fashion_mnist

    images, _ = load_fashion_mnist("test", fashion_mnist_dir)
    img = Image.fromarray(np.concatenate([images[0], images[1]], 1)).resize((512, 256), Image.BICUBIC)
    data = encode_jpeg(img.convert("RGB"))[0]
    full = decode_eval(data, 84, reduced_decode=False).astype(float)
    reduced = decode_eval(data, 84).astype(float)
    assert np.abs(full - reduced).mean() < 4.0  # same picture, up to resampling differences
    import random
    a = decode_train(data, 84, random.Random(1))
    b = decode_train(data, 84, random.Random(1))
    assert np.array_equal(a, b) and a.shape == (84, 84, 3)


def test_pipe_sources_and_weights(numbered, tmp_path):
    write_tar(tmp_path / "x.tar", [(f"{i:04d}.{e}", jpeg_bytes() if e == "jpg" else b"an unrelated red box")
                                   for i in range(10) for e in ("jpg", "txt")])
    piped = f"pipe:cat {numbered}/{{00000000..00000007}}.tar"
    stream = stream_of([piped, str(tmp_path / "x.tar")], weights=[1.0, 0.0], num_workers=0)
    assert stream.num_samples == 96 + 10  # pipe: sizes read from _stats.json through the same command
    rows = token_rows(take(stream, 4))
    box = tuple(truncate_tokens("an unrelated red box"))
    assert len(rows) == 32 and box not in rows  # weight 0: never drawn
    only_box = token_rows(take(stream_of([piped, str(tmp_path / "x.tar")], weights=[0.0, 1.0], num_workers=0), 2))
    assert set(only_box) == {box}


def truncate_tokens(text, context_length=16):
    """Token row of a caption with the truncate mask."""
    from crate_clip.data.text_reduction import TextReducer

    return TextReducer(context_length, "truncate")(text).tolist()


def test_epoch_mode_uneven_ranks_yield_equal_batch_counts(numbered):
    five = f"{numbered}/{{00000000..00000004}}.tar"  # 5 shards over 2 ranks: 36 vs 24 samples
    counts, rows = [], []
    for rank in range(2):
        stream = stream_of(five, mode="epoch", num_workers=2, batch_size=4, rank=rank, world_size=2)
        batches = list(stream)
        counts.append((len(batches), stream.batches_per_epoch))
        rows.append(set(token_rows(batches)))
    assert counts == [(6, 6), (6, 6)]  # nobody waits at a collective for a rank that has stopped
    assert not rows[0] & rows[1]


def test_one_exact_pass_when_streams_end_at_different_steps(numbered):
    """drop_last: false over 5 shards dealt to 4 streams (24, 12, 12, 12 samples; 2 per stream and step): the
    workers' parts of a step stay in order while the second worker's streams have ended."""
    five = f"{numbered}/{{00000000..00000004}}.tar"
    stream = stream_of(five, mode="epoch", drop_last=False, num_workers=2, canonical_streams=4)
    batches = list(stream)
    assert [len(tokens) for _, tokens in batches] == [8] * 6 + [2] * 6
    rows = token_rows(batches)
    assert len(rows) == len(set(rows)) == 60 and stream.epoch == 1


def test_resume_with_another_worker_count_is_exact(numbered):
    reference = token_rows(take(stream_of(numbered, num_workers=2, text_mask="random"), 6))
    two = stream_of(numbered, num_workers=2, text_mask="random")
    take(two, 3)
    one = stream_of(numbered, num_workers=0, text_mask="random")  # reads the 2 canonical streams of the state
    one.load_state_dict(json.loads(json.dumps(two.state_dict())))
    assert one.canonical_streams == 2 and token_rows(take(one, 3)) == reference[24:]


def test_state_without_stream_records_restarts_draws(numbered, caplog):
    """A state of per-worker positions (no canonical streams) keeps its counters and starts new draws."""
    per_worker = {"version": 1, "mode": "resampled", "seed": 0, "epoch": 0, "batches": 3, "generation": 0,
                  "workers": [{"group": 0, "offset": 9, "skips": {"empty_caption": 2}}],
                  "done_skips": {"missing_caption": 1}}
    one = stream_of(numbered, num_workers=0)
    one.load_state_dict(per_worker)
    assert "not exact" in caplog.text
    assert (one.skip_counts()["empty_caption"], one.skip_counts()["missing_caption"]) == (2, 1)
    fresh = token_rows(take(stream_of(numbered, num_workers=0), 3))
    after = token_rows(take(one, 3))
    assert after != fresh and len(after) == 24  # new draws, not a replay of a fresh start
    again = stream_of(numbered, num_workers=0)
    again.load_state_dict(json.loads(json.dumps(one.state_dict())))  # a second resume is exact again
    assert token_rows(take(again, 2)) == token_rows(take(one, 2))
