"""CLIPA text reduction masks and the offline part-of-speech sources behind the syntax mask."""
import random
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from crate_clip.data.pos_tagging import BuiltinTagger, WordNetTagger, find_wordnet_dir, select_pos_tagger
from crate_clip.data.text_reduction import TextReducer, load_tokenizer

TOK = load_tokenizer()
SOT, EOT = TOK.sot_token_id, TOK.eot_token_id
LONG = ("a photo of a small brown dog running across the green grass of a sunny park "
        "next to a large old wooden bench under tall trees while two children play football "
        "and a woman in a yellow raincoat reads a newspaper")


def nltk_available() -> bool:
    """Whether NLTK's English tagger data can be loaded (tests point NLTK_DATA at ../shared/nltk_data)."""
    try:
        select_pos_tagger("nltk")
        return True
    except LookupError:
        return False


def taggers():
    """Every POS source present here."""
    out = [BuiltinTagger()]
    if find_wordnet_dir():
        out.append(WordNetTagger())
    if nltk_available():
        out.append(select_pos_tagger("nltk"))
    return out


def content(row) -> list[int]:
    """Token ids between sot and eot."""
    row = [int(t) for t in row]
    assert row[0] == SOT
    return row[1:row.index(EOT)]


@pytest.mark.parametrize("context_length", [8, 16, 32])
def test_truncate_matches_open_clip(context_length):
    ours = TextReducer(context_length, "truncate", TOK)
    for text in (LONG, "a cat", "x" * 3):
        assert np.array_equal(ours(text), TOK([text], context_length=context_length)[0].numpy())


@pytest.mark.parametrize("context_length", [8, 16, 32])
def test_random_and_block_keep_order_and_length(context_length):
    full = TOK.encode(LONG)
    budget = context_length - 2
    assert len(full) > budget
    for mask in ("random", "block"):
        reducer = TextReducer(context_length, mask, TOK)
        outs = [content(reducer(LONG, random.Random(s))) for s in range(5)]
        assert all(len(o) == budget for o in outs)
        assert len({tuple(o) for o in outs}) > 1  # the draw depends on the seed
        assert content(reducer(LONG, random.Random(1))) == outs[1]  # and only on it
        for o in outs:
            if mask == "block":
                start = next(i for i in range(len(full)) if full[i:i + budget] == o)
                assert full[start:start + budget] == o
            else:  # an order-preserving subsequence
                it = iter(full)
                assert all(t in it for t in o)
    short = TextReducer(context_length, "random", TOK)("a red car", random.Random(0))
    assert content(short) == TOK.encode("a red car")  # nothing to drop


# Hand-checked: with 3 word slots the nouns survive; with 4, the first adjective joins them.
SENTENCES = [
    ("a photo of a small brown dog running on the green grass", 3, ["photo", "dog", "grass"]),
    ("a photo of a small brown dog running on the green grass", 4, ["photo", "small", "dog", "grass"]),
    ("two old men playing chess in a quiet park", 3, ["men", "chess", "park"]),
    ("two old men playing chess in a quiet park", 4, ["old", "men", "chess", "park"]),
    ("the red car is parked near a white house", 3, ["red", "car", "house"]),
]


@pytest.mark.parametrize("tagger", taggers(), ids=lambda t: t.source)
def test_syntax_keeps_nouns_then_adjectives(tagger):
    for text, slots, expected in SENTENCES:
        reducer = TextReducer(slots + 2, "syntax", TOK, pos_tagger=tagger)
        assert reducer.syntax_words(text, slots) == expected, (tagger.source, text)
        assert TOK.decode(content(reducer(text))).split() == expected


def test_syntax_cache_returns_what_tagging_gives_and_stops_growing(monkeypatch):
    """Repeated captions are tagged once; a cached row equals a fresh reducer's, and the cache holds at most its
    size (web captions rarely repeat)."""
    import crate_clip.data.text_reduction as text_reduction

    monkeypatch.setattr(text_reduction, "SYNTAX_CACHE_SIZE", 2)
    tagger = BuiltinTagger()
    reducer = TextReducer(8, "syntax", TOK, pos_tagger=tagger)
    captions = [LONG, LONG + " today", "a black and white photo of the ankle boot on a table", LONG]
    rows = [reducer(c) for c in captions]
    for caption, row in zip(captions, rows):
        assert np.array_equal(row, TextReducer(8, "syntax", TOK, pos_tagger=tagger)(caption))
    assert len(reducer._syntax_cache) == 2
    rows[0][1] = 0   # a returned row is the caller's own: changing it leaves the cache alone
    assert np.array_equal(reducer(LONG), rows[3])


def test_syntax_respects_token_budget_and_context_lengths():
    tagger = select_pos_tagger("auto")
    for length in (8, 16, 32):
        row = TextReducer(length, "syntax", TOK, pos_tagger=tagger)(LONG)
        assert row.shape == (length,) and row.dtype == np.int64 and len(content(row)) <= length - 2
    assert select_pos_tagger("builtin").source == "builtin"
    with pytest.raises(ValueError, match="pos source"):
        select_pos_tagger("spacy")


def emoji_captions(n=400):
    """n real captions: emoji CLDR names in caption templates (fixed sample)."""
    from crate_clip.data.sources.emoji import TEMPLATES, emoji_names

    names = emoji_names()
    rng = random.Random(0)
    return [rng.choice(TEMPLATES).format(name) for _, name in rng.sample(names, n)]


@pytest.mark.skipif(not Path("/usr/share/unicode/emoji/emoji-test.txt").is_file(), reason="unicode-data missing")
@pytest.mark.skipif(find_wordnet_dir() is None, reason="wordnet-base missing")
def test_wordnet_source_agrees_with_nltk_on_kept_words():
    if not nltk_available():
        pytest.skip("NLTK's tagger data (../shared/nltk_data) is not present")
    nltk_reducer = TextReducer(8, "syntax", TOK, pos_tagger=select_pos_tagger("nltk"))
    wn_reducer = TextReducer(8, "syntax", TOK, pos_tagger=WordNetTagger())
    kept = agree = 0
    for caption in emoji_captions():
        a, b = Counter(nltk_reducer.syntax_words(caption, 6)), Counter(wn_reducer.syntax_words(caption, 6))
        kept += sum(a.values())
        agree += sum((a & b).values())
    assert kept > 1000 and agree / kept >= 0.90, agree / kept


def test_stream_reports_pos_source(monkeypatch):
    # Without NLTK data the auto choice falls back to WordNet's files (or the word list).
    monkeypatch.setenv("NLTK_DATA", "/nonexistent")
    import nltk

    monkeypatch.setattr(nltk.data, "path", ["/nonexistent"])
    expected = "wordnet" if find_wordnet_dir() else "builtin"
    assert select_pos_tagger("auto").source == expected
    assert TextReducer(8, "syntax", TOK).pos_source == expected


@pytest.mark.parametrize("model", ["CRATE-alpha-CLIPA-tiny", "CRATE-alpha-CLIPA-tiny-crate-text"])
def test_masks_follow_the_tokenizer_whatever_the_text_tower(model):
    """The training stream tokenizes with the model config's tokenizer: CLIP's BPE for a transformer and for a
    CRATE-alpha text tower alike, so every reduction mask applies to either tower the same way."""
    from crate_clip.data.train_stream import _tokenizer

    for mask in ("truncate", "random", "block", "syntax"):
        ours, reference = TextReducer(16, mask, _tokenizer(model)), TextReducer(16, mask, TOK)
        assert np.array_equal(ours(LONG, random.Random(1)), reference(LONG, random.Random(1))), mask
