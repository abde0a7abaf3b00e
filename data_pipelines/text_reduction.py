"""CLIPA text token reduction: tokenize a caption to a stage's context length with a reduction mask.

Masks (CLIPA, "An Inverse Scaling Law for CLIP Training"): 'truncate' keeps the first tokens, 'random'
keeps a random subset in order, 'block' keeps a random contiguous span, 'syntax' keeps words by part of
speech (nouns, then adjectives, then verbs, then the rest) and restores their order. Like open_clip, the
sequence is `<sot> tokens <eot>` padded with zeros, so at most context_length - 2 caption tokens survive.
Unlike open_clip's syntax mode, the word choice respects the BPE token budget (a long word costs several
tokens) and ties keep the earlier word, so the result is deterministic for a given caption.
"""
from __future__ import annotations

import random
from typing import Literal, get_args

import numpy as np

from .pos_tagging import select_pos_tagger, split_words

TextMask = Literal["truncate", "random", "block", "syntax"]
TEXT_MASKS = get_args(TextMask)
_PRIORITY = {"noun": 0, "adj": 1, "verb": 2, "other": 3}
# the syntax mask's ids of the first distinct (caption, budget) pairs a reducer meets: tagging costs ~0.5 ms a
# caption, and a small data set repeats its captions (the demo's ~1,000 distinct ones); web captions rarely repeat,
# so the cache stops growing at this size rather than evicting
SYNTAX_CACHE_SIZE = 16384


def load_tokenizer(name: str = "clip-bpe"):
    """CLIP's BPE tokenizer ('clip-bpe') or the tokenizer of an open_clip model name."""
    import open_clip

    if name in ("clip-bpe", "clip", "openai"):
        return open_clip.tokenizer._tokenizer  # the SimpleTokenizer open_clip builds at import (saves ~1 s)
    return open_clip.get_tokenizer(name)


class TextReducer:
    """Caption -> int64 token ids of length context_length under one reduction mask."""

    def __init__(self, context_length: int, mask: str = "truncate", tokenizer=None, pos_tagger=None,
                 pos_source: str = "auto"):
        if mask not in TEXT_MASKS:
            raise ValueError(f"text_mask {mask!r} is not one of {TEXT_MASKS}")
        if context_length < 3:
            raise ValueError(f"context_length must be >= 3 (sot, one token, eot), got {context_length}")
        self.context_length = context_length
        self.mask = mask
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer()
        if not hasattr(self.tokenizer, "encode") or not hasattr(self.tokenizer, "sot_token_id"):
            if mask != "truncate":
                raise ValueError(f"text_mask {mask!r} needs a BPE tokenizer with encode/sot/eot "
                                 f"(open_clip SimpleTokenizer); {type(self.tokenizer).__name__} has none")
        self.pos_tagger = pos_tagger
        self._syntax_cache: dict[tuple[str, int], list[int]] = {}
        if mask == "syntax" and pos_tagger is None:
            self.pos_tagger = select_pos_tagger(pos_source)

    @property
    def pos_source(self) -> str:
        """Name of the active part-of-speech source ('nltk' | 'wordnet' | 'builtin'), or 'none'."""
        return self.pos_tagger.source if self.pos_tagger is not None else "none"

    def __call__(self, text: str, rng: random.Random | None = None) -> np.ndarray:
        """Token ids (int64, shape (context_length,)) of one caption; rng drives the random masks."""
        tok = self.tokenizer
        if not hasattr(tok, "encode") or not hasattr(tok, "sot_token_id"):
            return tok([text], context_length=self.context_length)[0].numpy().astype(np.int64)
        budget = self.context_length - 2
        ids = tok.encode(text)
        if len(ids) > budget:
            rng = rng or random.Random(0)
            if self.mask == "truncate":
                ids = ids[:budget]
            elif self.mask == "random":
                ids = [ids[i] for i in sorted(rng.sample(range(len(ids)), budget))]
            elif self.mask == "block":
                start = rng.randint(0, len(ids) - budget)
                ids = ids[start:start + budget]
            else:
                ids = self.syntax_ids(text, budget)
        out = np.zeros(self.context_length, dtype=np.int64)
        out[0] = tok.sot_token_id
        out[1:len(ids) + 1] = ids
        out[len(ids) + 1] = tok.eot_token_id
        return out

    def syntax_ids(self, text: str, budget: int) -> list[int]:
        """BPE ids of the words kept by part-of-speech priority within `budget` tokens, in caption order."""
        ids = self._syntax_cache.get((text, budget))
        if ids is None:
            ids = [i for w in self.syntax_words(text, budget) for i in self.tokenizer.encode(w)][:budget]
            if len(self._syntax_cache) < SYNTAX_CACHE_SIZE:
                self._syntax_cache[(text, budget)] = ids
        return list(ids)

    def syntax_words(self, text: str, budget: int) -> list[str]:
        """Words kept by the syntax mask (nouns, adjectives, verbs, rest; earlier first), caption order."""
        words = split_words(text)
        classes = self.pos_tagger.tag(words)
        costs = [len(self.tokenizer.encode(w)) for w in words]
        order = sorted(range(len(words)), key=lambda i: (_PRIORITY[classes[i]], i))
        keep, used = set(), 0
        for i in order:
            if costs[i] and used + costs[i] <= budget:
                keep.add(i)
                used += costs[i]
            if used >= budget:
                break
        return [words[i] for i in sorted(keep)]
