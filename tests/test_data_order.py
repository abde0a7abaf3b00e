"""The global sample order: one sequence of global batches for any number of ranks and DataLoader workers,
continued exactly by a resume at another world size; bad samples move only their own stream."""
import json
import shutil
import tarfile

import pytest
import torch

from crate_clip.data.stream_layout import LayoutError, merge_stream_states, split_stream_state
from crate_clip.data.train_stream import StreamConfig, build_train_stream

from data_fixtures import write_numbered_shards, write_tar

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

GLOBAL_BATCH = 8
LAYOUTS = [(1, 0), (1, 2), (2, 1), (4, 1), (2, 2)]   # (world size, DataLoader workers)


@pytest.fixture(scope="module")
def numbered(tmp_path_factory, fashion_mnist_dir):
    """8 shards x 12 numbered Fashion-MNIST samples (keys 000000000000 ... identify samples)."""
    out = tmp_path_factory.mktemp("order")
    write_numbered_shards(out, 96, 12, fashion_mnist_dir)
    return out


def rank_streams(src, world: int, workers: int, **kw) -> list:
    """The streams of every rank of a `world`-rank job, built in this process."""
    cfg = StreamConfig(sources=[str(src)], num_workers=workers, shuffle_buffer=20, **kw)
    return [build_train_stream(cfg, image_size=28, context_length=16, text_mask="random",
                               batch_size=GLOBAL_BATCH // world, rank=r, world_size=world) for r in range(world)]


def global_batches(streams: list, n: int) -> list[tuple]:
    """The next n global batches as (keys, images, tokens): the rank batches in rank order. An epoch end (every
    rank's pass ends at the same step) starts the next pass, as the trainer does."""
    iters = [iter(s) for s in streams]
    out = []
    for _ in range(n):
        keys, images, tokens = [], [], []
        for r, stream in enumerate(streams):
            try:
                batch = next(iters[r])
            except StopIteration:
                iters[r] = iter(stream)
                batch = next(iters[r])
            keys += stream.batch_keys
            images.append(batch[0])
            tokens.append(batch[1])
        out.append((keys, torch.cat(images), torch.cat(tokens)))
    return out


def keys_of(batches: list[tuple]) -> list[list[str]]:
    return [b[0] for b in batches]


@pytest.mark.parametrize("mode,steps", [("resampled", 6), ("epoch", 14)])
def test_global_batches_do_not_depend_on_ranks_or_workers(numbered, mode, steps):
    reference = global_batches(rank_streams(numbered, 1, 0, mode=mode, canonical_streams=4), steps)
    if mode == "epoch":  # 12 steps per epoch: every sample once, then the next epoch's order
        first_epoch = [k for keys in keys_of(reference[:12]) for k in keys]
        assert len(first_epoch) == len(set(first_epoch)) == 96 and keys_of(reference[12:]) != keys_of(reference[:2])
    for world, workers in LAYOUTS[1:]:
        got = global_batches(rank_streams(numbered, world, workers, mode=mode, canonical_streams=4), steps)
        assert keys_of(got) == keys_of(reference), (world, workers)
        # the same crops and text-mask draws too (each sample's generator is seeded by its stream position)
        assert all(torch.equal(a[1], b[1]) and torch.equal(a[2], b[2]) for a, b in zip(got, reference))


def saved_states(src, steps: int, **kw) -> list[dict]:
    """The stream states of both ranks of a 2-rank, 2-worker job after `steps` global batches (JSON round trip)."""
    streams = rank_streams(src, 2, 2, **kw)
    global_batches(streams, steps)
    return [json.loads(json.dumps(s.state_dict())) for s in streams]


def resumed(src, world: int, workers: int, states: list[dict], **kw) -> list:
    """A `world`-rank job's streams loaded from the states of another job: rank 0 from the merged table, the
    other ranks from their split of it (both forms are accepted)."""
    table = merge_stream_states(states)
    streams = rank_streams(src, world, workers, **kw)
    for r, stream in enumerate(streams):
        stream.load_state_dict(table if r == 0 else split_stream_state(table, r, world))
    return streams


def test_resume_at_another_world_size_continues_the_sequence(numbered):
    # canonical_streams unset: the first launch (2 ranks x 2 workers) fixes 4, recorded in its state
    reference = keys_of(global_batches(rank_streams(numbered, 2, 2), 9))
    states = saved_states(numbered, 4)
    assert [s["canonical_streams"] for s in states] == [4, 4] and sorted(states[1]["streams"]) == ["2", "3"]
    for world, workers in [(1, 0), (1, 2), (4, 1)]:
        streams = resumed(numbered, world, workers, states)
        assert streams[0].canonical_streams == 4
        assert keys_of(global_batches(streams, 5)) == reference[4:], (world, workers)


def test_epoch_resume_across_the_epoch_end_at_another_world_size(numbered):
    reference = keys_of(global_batches(rank_streams(numbered, 2, 2, mode="epoch"), 15))
    states = saved_states(numbered, 10, mode="epoch")
    for world, workers in [(1, 0), (4, 1)]:
        streams = resumed(numbered, world, workers, states, mode="epoch")
        after = keys_of(global_batches(streams, 5))
        assert after == reference[10:], (world, workers)
        assert streams[0].epoch == 1
    seen = [k for keys in reference[:12] for k in keys]
    assert len(set(seen)) == 96  # the uninterrupted epoch: no sample repeated or skipped


def test_state_table_merge_and_split(numbered):
    states = saved_states(numbered, 3)
    table = merge_stream_states(states[::-1])   # any order
    assert sorted(map(int, table["streams"])) == [0, 1, 2, 3] and table["samples"] == 3 * GLOBAL_BATCH
    assert split_stream_state(table, 1, 2)["streams"] == states[1]["streams"]
    with pytest.raises(ValueError, match=r"lack canonical streams \[2, 3\]"):
        merge_stream_states(states[:1])
    with pytest.raises(ValueError, match="not from one checkpoint"):
        merge_stream_states([states[0], {**states[1], "batches": 2}])
    lone = rank_streams(numbered, 1, 0)[0]
    with pytest.raises(ValueError, match=r"lacks canonical streams \[2, 3\] of rank 0"):
        lone.load_state_dict(states[0])   # rank 0 of 2 holds streams 0-1 only: one process needs all four


def test_skip_counts_add_up_across_a_resize(tmp_path, numbered):
    bad = corrupted_copy(numbered, tmp_path, "000000000005")
    states = saved_states(bad, 12, mode="epoch")   # the whole first epoch
    before = sum(s["streams"][c]["skips"].get("undecodable_image", 0) for s in states for c in s["streams"])
    streams = resumed(bad, 4, 1, states, mode="epoch")
    after = sum(s.skip_counts()["undecodable_image"] for s in streams)
    assert before == after == 1


def corrupted_copy(src, dest, key: str):
    """A copy of the shards in which sample `key`'s image is not a JPEG (same key, same shard, same size)."""
    out = dest / "corrupt"
    shutil.copytree(src, out)
    for tar_path in sorted(out.glob("*.tar")):
        with tarfile.open(tar_path) as tar:
            members = [(m.name, tar.extractfile(m).read()) for m in tar if m.isreg()]
        if any(name.startswith(key) for name, _ in members):
            write_tar(tar_path, [(name, b"\xff\xd8 not a jpeg" if name == f"{key}.jpg" else data)
                                 for name, data in members])
    return out


def per_stream(keys: list[list[str]], streams: int) -> list[list[str]]:
    """Each canonical stream's samples, in order, from a sequence of global batches' keys."""
    size = len(keys[0]) // streams
    return [[k for batch in keys for k in batch[c * size:(c + 1) * size]] for c in range(streams)]


def decoded_copies(stream_keys: list[str], usable: int, victim: str) -> int:
    """How often a stream decoded `victim` while it yielded its first `usable` other samples."""
    count = used = 0
    for key in stream_keys:
        if used == usable:
            break
        count, used = (count + 1, used) if key == victim else (count, used + 1)
    return count


@pytest.mark.parametrize("mode", ["resampled", "epoch"])
def test_a_bad_sample_moves_only_its_own_stream(numbered, tmp_path, mode):
    clean = per_stream(keys_of(global_batches(rank_streams(numbered, 1, 0, mode=mode, canonical_streams=4), 11)), 4)
    victim = clean[2][5]  # a sample of stream 2 (in resampled mode other streams may draw its shard too)
    bad_streams = rank_streams(corrupted_copy(numbered, tmp_path, victim), 1, 0, mode=mode, canonical_streams=4)
    bad = per_stream(keys_of(global_batches(bad_streams, 10)), 4)
    for c in range(4):
        expected = [k for k in clean[c] if k != victim][:len(bad[c])]
        assert bad[c] == expected, c   # the stream that held it closes the gap; the others do not move
    assert bad[2] != clean[2][:len(bad[2])]
    skipped = sum(decoded_copies(clean[c], len(bad[c]), victim) for c in range(4))
    assert bad_streams[0].skip_counts()["undecodable_image"] == skipped >= 1
    if mode == "epoch":
        assert skipped == 1   # dealt to one stream only


def build_one(src, world_size: int = 1, **kw):
    """Rank 0's stream with a batch of 8 / world_size (no DataLoader workers)."""
    cfg = StreamConfig(sources=[str(src)], num_workers=0, shuffle_buffer=20, **kw)
    return build_train_stream(cfg, image_size=28, context_length=16, text_mask="truncate",
                              batch_size=max(1, GLOBAL_BATCH // world_size), world_size=world_size)


def test_canonical_stream_count_errors(numbered):
    with pytest.raises(LayoutError, match=r"data\.canonical_streams=2 is not a multiple of world_size=4.*e\.g\. 4"):
        build_one(numbered, 4, canonical_streams=2)
    with pytest.raises(LayoutError, match=r"data\.canonical_streams=4 is not divisible by world_size x num_workers "
                                          r"= 1 x 3.*fix: data\.num_workers a divisor of 4"):
        rank_streams(numbered, 1, 3, canonical_streams=4)
    with pytest.raises(LayoutError, match=r"data\.canonical_streams=16 does not divide the global batch 8"):
        build_one(numbered, canonical_streams=16)
    with pytest.raises(ValueError, match=r"at least one shard per canonical stream: 8 shards for "
                                         r"data\.canonical_streams=16.*resampled"):
        cfg = StreamConfig(sources=[str(numbered)], mode="epoch", canonical_streams=16, num_workers=0)
        build_train_stream(cfg, image_size=28, context_length=16, text_mask="truncate", batch_size=16)
    # a count set in the config must be the one the state was saved with; an unset one is read from the state
    state = saved_states(numbered, 1)[0]
    with pytest.raises(ValueError, match=r"data\.canonical_streams=2 but the stream state was saved with 4; "
                                         r"fix: data\.canonical_streams: 4"):
        build_one(numbered, 2, canonical_streams=2).load_state_dict(state)
    with pytest.raises(LayoutError, match=r"canonical_streams=4 \(recorded in the checkpoint\) is not a multiple of "
                                          r"world_size=8"):
        build_one(numbered, 8).load_state_dict(merge_stream_states(saved_states(numbered, 1)))
