"""Offline part-of-speech sources for CLIPA's syntax text mask: NLTK's tagger, WordNet's database, a word list.

Every tagger maps a list of words to coarse classes 'noun' | 'adj' | 'verb' | 'other' (the only
distinction the syntax mask needs: nouns are kept first, then adjectives, then verbs, then the rest).
`select_pos_tagger('auto')` picks the best one installed, so syntax masking never needs the network.
"""
from __future__ import annotations

import os
import re
from functools import lru_cache
from pathlib import Path
from typing import Literal, get_args

WORD_RE = re.compile(r"\w+|[^\w\s]+")  # the same split as nltk.wordpunct_tokenize, usable without nltk
WORDNET_DIRS = (os.environ.get("WNHOME", ""), "/usr/share/wordnet", "/usr/local/share/wordnet",
                "/usr/share/wordnet/dict", "/opt/homebrew/share/wordnet")
POS_CLASSES = ("noun", "adj", "verb", "other")
PosSource = Literal["auto", "nltk", "wordnet", "builtin"]  # auto: the first of the others available

# Closed-class English words (determiners, pronouns, prepositions, conjunctions, auxiliaries, particles,
# frequent adverbs). WordNet lists many of them as nouns ("a" = vitamin A, "in" = indium), so every
# tagger here checks this list first.
CLOSED_CLASS = frozenset("""
a an the this that these those some any no every each either neither both all half another such what which
whose whichever whatever my your his her its our their mine yours hers ours theirs i me you he him she it we
us they them myself yourself himself herself itself ourselves themselves one ones someone somebody something
anyone anybody anything everyone everybody everything nobody nothing who whom whoever
of in on at by for with without within from to into onto upon over under above below between among through
during before after behind beside besides near off out up down about around across along against toward
towards via per than like unlike until till since despite inside outside beyond throughout amid underneath
and or but nor so yet because although though while whereas if unless whether as once when whenever where
wherever how why then
is am are was were be been being do does did done doing have has had having will would shall should can could
may might must ought 's 're 've 'm 'll 'd n't not
very too also just only even still already again ever never always often sometimes here there now
more most less least much many few several other others own same
two three four five six seven eight nine ten eleven twelve twenty hundred thousand
""".split())
PUNCT_RE = re.compile(r"^[^\w]+$")
# Suffix guesses for the word-list tagger (and for words WordNet does not know).
ADJ_SUFFIXES = ("ous", "ful", "ive", "able", "ible", "al", "ic", "less", "ish", "ian", "ary", "est")
VERB_SUFFIXES = ("ing", "ed", "ize", "ise", "ify", "ate")


def split_words(text: str) -> list[str]:
    """Split a caption into words and punctuation runs (nltk.wordpunct_tokenize's rule)."""
    return WORD_RE.findall(text)


def _guess_by_suffix(word: str) -> str:
    """Coarse class of an unknown open-class word from its ending; nouns are the majority class."""
    if word.isdigit():
        return "other"
    if len(word) > 4 and word.endswith("ly"):
        return "other"  # adverb
    if len(word) > 5 and word.endswith(VERB_SUFFIXES):
        return "verb"
    if len(word) > 4 and word.endswith(ADJ_SUFFIXES):
        return "adj"
    return "noun"


def _closed_or_punct(word: str) -> bool:
    """Whether a (lower-cased) word is punctuation or a closed-class function word."""
    return word in CLOSED_CLASS or bool(PUNCT_RE.match(word)) or word.isdigit()


class BuiltinTagger:
    """Closed-class word list plus suffix guesses: always available, no data files."""

    source = "builtin"

    def tag(self, words: list[str]) -> list[str]:
        """Coarse part-of-speech class of each word."""
        out = ["other" if _closed_or_punct(w.lower()) else _guess_by_suffix(w.lower()) for w in words]
        # English noun phrases end in their head noun: in a run of noun guesses ("small brown dog")
        # every word but the last is a modifier.
        for i in range(len(out) - 1):
            if out[i] == "noun" and out[i + 1] == "noun":
                out[i] = "adj"
        return out


class NltkTagger:
    """NLTK's averaged-perceptron tagger (needs its data installed; raises LookupError otherwise)."""

    source = "nltk"

    def __init__(self):
        from nltk.tag import PerceptronTagger  # loads taggers/averaged_perceptron_tagger_eng from NLTK_DATA

        self._tagger = PerceptronTagger()

    def tag(self, words: list[str]) -> list[str]:
        """Coarse part-of-speech class of each word (Penn tags NN*, JJ*, VB*)."""
        return [penn_to_coarse(tag) for _, tag in self._tagger.tag(list(words))] if words else []


def penn_to_coarse(tag: str) -> str:
    """Map a Penn Treebank tag to 'noun' | 'adj' | 'verb' | 'other' (the syntax mask's priorities)."""
    if tag.startswith("NN"):
        return "noun"
    if tag.startswith("JJ"):
        return "adj"
    if tag.startswith("VB"):
        return "verb"
    return "other"


# WordNet's morphological detachment rules (wndb(5) / morphy(7)): suffix -> replacement, per part of speech.
_DETACH = {
    "noun": (("ses", "s"), ("xes", "x"), ("zes", "z"), ("ches", "ch"), ("shes", "sh"), ("men", "man"),
             ("ies", "y"), ("s", "")),
    "verb": (("ies", "y"), ("es", "e"), ("es", ""), ("ed", "e"), ("ed", ""), ("ing", "e"), ("ing", ""),
             ("s", "")),
    "adj": (("er", ""), ("est", ""), ("er", "e"), ("est", "e")),
    "adv": (),
}
_WN_FILES = {"noun": "noun", "verb": "verb", "adj": "adj", "adv": "adv"}


def find_wordnet_dir() -> Path | None:
    """The first folder holding WordNet's index.noun (Debian's wordnet-base puts it in /usr/share/wordnet)."""
    for d in WORDNET_DIRS:
        if d and (Path(d) / "index.noun").is_file():
            return Path(d)
    return None


class WordNetTagger:
    """Part of speech from WordNet's database files (index.* and *.exc), read directly, no NLTK corpus.

    A word gets the WordNet part of speech with the most sense-tagged occurrences (the `tagsense_cnt`
    field of index.*, i.e. how often that reading appears in the SemCor corpus), after WordNet's own
    morphology (exception lists, then detachment rules). A little context fixes the common ambiguity of
    CLIP captions: a word right after a determiner or an adjective is not a verb.
    """

    source = "wordnet"

    def __init__(self, wordnet_dir: str | Path | None = None):
        wn = Path(wordnet_dir) if wordnet_dir else find_wordnet_dir()
        if wn is None or not (wn / "index.noun").is_file():
            raise LookupError(f"WordNet database not found (looked in {', '.join(d for d in WORDNET_DIRS if d)})")
        self.dir = wn
        self.counts, self.exceptions = _load_wordnet(str(wn))

    def _lemma_scores(self, word: str) -> dict[str, int]:
        """Best tag-count for each part of speech under which some base form of `word` is listed."""
        scores: dict[str, int] = {}
        for pos in ("noun", "verb", "adj", "adv"):
            for base in self._base_forms(word, pos):
                if (base, pos) in self.counts:
                    scores[pos] = max(scores.get(pos, -1), self.counts[(base, pos)])
        return scores

    def _base_forms(self, word: str, pos: str) -> list[str]:
        """WordNet's morphy: the word itself, its exception-list base forms, then detachment results."""
        forms = [word] + self.exceptions.get((word, pos), [])
        forms += [word[: -len(suf)] + rep for suf, rep in _DETACH[pos] if word.endswith(suf) and len(word) > len(suf) + 1]
        return forms

    def tag_word(self, word: str, previous: str | None) -> str:
        """Coarse class of one lower-cased word given the coarse class of the word before it."""
        if _closed_or_punct(word):
            return "other"
        scores = self._lemma_scores(word)
        if not scores:
            return _guess_by_suffix(word)
        if previous in ("det", "adj") and "verb" in scores and len(scores) > 1:
            scores.pop("verb")  # "a running dog": after a determiner or adjective a verb reading is unlikely
        # Ties go to the earlier class: noun, adj, verb, adv. A word WordNet lists with an inflected form
        # (plural "-s" or "-ing") is read by its surface shape first.
        order = ("noun", "adj", "verb", "adv")
        best = max(order, key=lambda p: (scores.get(p, -1), -order.index(p)))
        return "other" if best == "adv" else best

    def tag(self, words: list[str]) -> list[str]:
        """Coarse part-of-speech class of each word."""
        out, previous = [], None
        lowered = [w.lower() for w in words]
        for lw in lowered:
            cls = self.tag_word(lw, previous)
            out.append(cls)
            previous = "det" if lw in _DETERMINERS else cls
        # "light skin", "red heart": a word with an adjective reading right before a noun modifies it.
        for i in range(len(out) - 1):
            if out[i] == "noun" and out[i + 1] == "noun" and self._has_adj_reading(lowered[i]):
                out[i] = "adj"
        return out

    def _has_adj_reading(self, word: str) -> bool:
        """Whether WordNet lists the word (or a base form of it) as an adjective."""
        return any((base, "adj") in self.counts for base in self._base_forms(word, "adj"))


_DETERMINERS = frozenset("a an the this that these those my your his her its our their some any no every each".split())


@lru_cache(maxsize=4)
def _load_wordnet(wordnet_dir: str) -> tuple[dict, dict]:
    """Read index.{noun,verb,adj,adv} (lemma -> tag count) and *.exc (inflected -> base forms)."""
    counts: dict[tuple[str, str], int] = {}
    exceptions: dict[tuple[str, str], list[str]] = {}
    root = Path(wordnet_dir)
    for pos, name in _WN_FILES.items():
        with open(root / f"index.{name}", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(" "):
                    continue  # licence header lines start with two spaces
                fields = line.split()
                # lemma pos synset_cnt p_cnt [ptr_symbol]*p_cnt sense_cnt tagsense_cnt synset_offset...
                p_cnt = int(fields[3])
                tagsense = int(fields[5 + p_cnt])
                counts[(fields[0], pos)] = tagsense
        exc = root / f"{name}.exc"
        if exc.is_file():
            with open(exc, encoding="utf-8", errors="replace") as f:
                for line in f:
                    fields = line.split()
                    if len(fields) >= 2:
                        exceptions.setdefault((fields[0], pos), []).extend(fields[1:])
    return counts, exceptions


def select_pos_tagger(prefer: str = "auto"):
    """Return a tagger: 'auto' tries NLTK's data, then WordNet's database, then the built-in word list."""
    order = {"auto": ("nltk", "wordnet", "builtin"), **{name: (name,) for name in get_args(PosSource)[1:]}}
    if prefer not in order:
        raise ValueError(f"pos source {prefer!r} is not one of {sorted(order)}")
    errors = []
    for name in order[prefer]:
        try:
            if name == "nltk":
                return NltkTagger()
            if name == "wordnet":
                return WordNetTagger()
            return BuiltinTagger()
        except (ImportError, LookupError, OSError) as exn:
            errors.append(f"{name}: {str(exn).strip().splitlines()[0] if str(exn).strip() else type(exn).__name__}")
    raise LookupError(f"no part-of-speech source {prefer!r} is available ({'; '.join(errors)})")
