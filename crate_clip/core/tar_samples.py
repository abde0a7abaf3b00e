"""Samples of a tar, read within bounds: its members (tar_members.py) grouped by key as webdataset groups them,
each member within its cap and all the members of a sample within one budget together. The one reader of shards
for training (crate_clip.data's shard_reader.py counts the skipped samples) and evaluation (crate_clip.eval's
eval_datasets.py names them).

A member above its cap, or one that would take its sample past the sample budget, is passed over unread and the
rest of its sample with it: the sample comes out as `{'__key__': key, '__skip__': reason}` holding no member. A
sample whose key repeats within the tar (or one extension twice) is skipped the same way (`duplicate_key`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import BinaryIO, Iterator

from webdataset.tariterators import base_plus_ext

from crate_clip.core.read_bounds import MAX_CAPTION_BYTES, MAX_MEMBER_BYTES, MAX_SAMPLE_BYTES
from crate_clip.core.tar_members import BLOCK, iter_members

# the reasons a sample is skipped here (the training stream counts them under these names)
SAMPLE_SKIPS = ("duplicate_key", "oversized_member", "oversized_caption", "oversized_sample")


@dataclass(frozen=True)
class SampleCaps:
    """Sizes above which a member is passed over unread and its sample skipped: any member (data.max_member_bytes),
    a caption (data.max_caption_bytes), and all of one sample's members, each with its 512-byte header
    (data.max_sample_bytes)."""

    member_bytes: int = MAX_MEMBER_BYTES
    caption_bytes: int = MAX_CAPTION_BYTES
    sample_bytes: int = MAX_SAMPLE_BYTES

    def member_cap(self, name: str) -> int:
        """The cap of the member called `name` on its own."""
        return self.caption_bytes if name.lower().endswith(".txt") else self.member_bytes


def held_bytes(sample: dict) -> int:
    """What a raw sample counts against a budget: its members' bytes, each with a header's 512."""
    return sum(len(value) + BLOCK for value in sample.values() if isinstance(value, bytes))


class TarSamples:
    """Iterating yields the raw samples of an uncompressed tar stream, in order: `{'__key__', '__url__', ext:
    bytes}`, or `{'__key__', '__url__', '__skip__': reason}` for a skipped one. The reader's errors pass through
    (tar_members.py); `started` says whether a member was read before one, and `pending` is the sample the tar
    broke off in (its complete members), which `finish_pending` turns into a sample."""

    def __init__(self, stream: BinaryIO, caps: SampleCaps = SampleCaps(), url: str | None = None):
        self.stream, self.caps, self.url = stream, caps, url
        self.started = False
        self.pending: dict | None = None
        self._held = 0              # the pending sample's bytes, headers included
        self._exts: set[str] = set()
        self._seen: set[str] = set()

    def __iter__(self) -> Iterator[dict]:
        for member in iter_members(self.stream, self._cap):
            key, ext = base_plus_ext(member.name)
            if key is None:
                continue
            self.started = True
            if self.pending is not None and key != self.pending["__key__"]:
                yield self.finish_pending()
            if self.pending is None:
                self.pending, self._held, self._exts = {"__key__": key, "__url__": self.url}, 0, set()
            self._add(ext.lower(), member.name, member.size, member.data)
        if self.pending is not None:
            yield self.finish_pending()

    def _cap(self, name: str) -> int:
        """The most bytes member `name` may have to be read: its own cap, and what the budget of its sample (the
        pending one, when the name continues it) has left. -1 (passed over) for a name that is no sample's member
        and for the rest of a sample already skipped."""
        key, _ = base_plus_ext(name)
        if key is None:
            return -1
        same = self.pending is not None and key == self.pending["__key__"]
        if same and "__oversized__" in self.pending:
            return -1
        return min(self.caps.member_cap(name), self.caps.sample_bytes - (self._held if same else 0) - BLOCK)

    def _add(self, ext: str, name: str, size: int, data: bytes | None) -> None:
        sample = self.pending
        if ext in self._exts:
            sample["__duplicate__"] = True
        self._exts.add(ext)
        if "__oversized__" in sample:
            return
        if data is None:   # passed over: the sample is skipped, what it had read is let go
            own_cap = self.caps.member_cap(name)
            reason = ("oversized_sample" if size <= own_cap else
                      "oversized_caption" if ext == "txt" else "oversized_member")
            self.pending = {key: sample[key] for key in ("__key__", "__url__", "__duplicate__") if key in sample}
            self.pending["__oversized__"] = reason
            return
        sample[ext] = data
        self._held += size + BLOCK

    def finish_pending(self) -> dict:
        """The pending sample as a finished one (skipped when its key was seen before in this tar, an extension
        repeats, or a member was passed over for its size); pending is None after."""
        sample, self.pending = self.pending, None
        key = sample["__key__"]
        duplicate = sample.pop("__duplicate__", False) or key in self._seen
        self._seen.add(key)
        oversized = sample.pop("__oversized__", None)
        if duplicate or oversized:
            reason = "duplicate_key" if duplicate else oversized
            return {"__key__": key, "__url__": sample["__url__"], "__skip__": reason}
        return sample
