"""Tokenizers of the CLIP configs: CLIP's BPE, or CLIPA's BERT WordPiece from the hub or a local vocabulary.

CLIPA's text tower reads BERT-base-uncased WordPiece ids through open_clip's HFTokenizer
(`strip_sep_token`): [CLS] + up to context-2 pieces, the [SEP] replaced by 0, padded with 0. The
vocabulary comes from transformers (`bert-base-uncased`, hub or HF cache) or, offline, from a folder
holding `vocab.txt` (run config `model.bert_vocab`, CLI `--bert-vocab`). transformers needs a
tokenizer_config.json beside the vocabulary; it is written into a cache folder keyed by the
vocabulary's hash, never into the user's folder.
"""
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Dict, Optional, Union

import open_clip

from crate_clip.checkpoint_io.bounded_reads import read_small_bytes, read_small_json
from crate_clip.core.errors import UserError
from crate_clip.models.export_files import CONFIG_FILE, LOCAL_DIR

HUB_PROBE_TIMEOUT_S = 5   # one request to the hub before transformers' own retries
MAX_VOCAB_BYTES = 16 << 20   # bert-base-uncased's vocab.txt: 232 KB; a 250,000-token vocabulary: ~5 MB
BERT_TOKENIZER_CONFIG = {"tokenizer_class": "BertTokenizer", "do_lower_case": True, "model_max_length": 512}


class TokenizerUnavailableError(UserError, RuntimeError):
    """The model's tokenizer cannot be loaded (no hub, not cached, no local vocabulary); says how to fix it."""


def default_cache_dir() -> Path:
    """Where crate_clip caches derived files: $CRATE_CLIP_CACHE, else ~/.cache/crate_clip."""
    return Path(os.environ.get("CRATE_CLIP_CACHE") or Path.home() / ".cache" / "crate_clip")


def _vocab_file(vocab: Union[str, Path]) -> Path:
    path = Path(vocab)
    path = path / "vocab.txt" if path.is_dir() else path
    if not path.is_file():
        raise FileNotFoundError(f"BERT vocabulary not found: {path} (a folder holding vocab.txt, one token a line)")
    return path


def _vocab_bytes(vocab: Union[str, Path]) -> bytes:
    """The vocabulary file's bytes, read only as a regular file of at most MAX_VOCAB_BYTES (a run folder or a
    checkpoint from elsewhere names it; a link to a sparse file of gigabytes is refused from its size)."""
    return read_small_bytes(_vocab_file(vocab), MAX_VOCAB_BYTES)


def bert_tokenizer_dir(vocab: Union[str, Path], cache_dir: Union[str, Path, None] = None) -> Path:
    """A folder transformers loads offline: a copy of `vocab` (folder or vocab.txt) and a BertTokenizer
    config, in `cache_dir`/bert_vocab/<hash of the vocabulary>."""
    data = _vocab_bytes(vocab)
    folder = Path(cache_dir or default_cache_dir()) / "bert_vocab" / hashlib.sha1(data).hexdigest()[:16]
    if not (folder / "tokenizer_config.json").is_file():
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".tmp-"))
        (tmp / "vocab.txt").write_bytes(data)
        (tmp / "tokenizer_config.json").write_text(json.dumps(BERT_TOKENIZER_CONFIG))
        try:
            os.replace(tmp, folder)  # a concurrent writer may have won: its copy is identical
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
    return folder


def bert_text_cfg(vocab: Union[str, Path], cache_dir: Union[str, Path, None] = None) -> Dict:
    """text_cfg overrides for a BERT WordPiece vocabulary (CLIPA's text setup): the vocabulary's size, no
    causal mask, pooling at the last position, the [SEP] stripped."""
    vocab_size = sum(1 for line in _vocab_bytes(vocab).decode("utf-8").splitlines() if line)
    return {"hf_tokenizer_name": str(bert_tokenizer_dir(vocab, cache_dir)), "vocab_size": vocab_size,
            "tokenizer_kwargs": {"strip_sep_token": True}, "no_causal_mask": True, "pool_type": "last"}


def bert_tokenizer(vocab: Union[str, Path], context_length: int = 32, cache_dir: Union[str, Path, None] = None):
    """open_clip HFTokenizer over a local BERT vocabulary: lower-cases, [CLS] + pieces, [SEP] -> 0, pads with 0."""
    return open_clip.tokenizer.HFTokenizer(str(bert_tokenizer_dir(vocab, cache_dir)), context_length=context_length,
                                           strip_sep_token=True)


def _text_cfg(model_name: str) -> Dict:
    if model_name.startswith(LOCAL_DIR):
        path = Path(model_name[len(LOCAL_DIR):]) / CONFIG_FILE
        return read_small_json(path)["model_cfg"].get("text_cfg", {}) if path.is_file() else {}
    return (open_clip.get_model_config(model_name) or {}).get("text_cfg", {})


def _hub_unreachable(repo: str) -> Optional[str]:
    """Why the HuggingFace tokenizer `repo` cannot come from the hub now, or None (a local folder, in the HF
    cache, or the hub answers). Asked first because transformers, offline without HF_HUB_OFFLINE, retries
    the hub for tens of seconds before failing; this is one request with a short timeout."""
    if Path(repo).is_dir():
        return None
    import huggingface_hub
    from huggingface_hub.errors import HfHubHTTPError

    if any(isinstance(huggingface_hub.try_to_load_from_cache(repo, name), str)
           for name in ("tokenizer_config.json", "vocab.txt", "tokenizer.json")):
        return None
    if huggingface_hub.constants.HF_HUB_OFFLINE:
        return "not in the HuggingFace cache, and HF_HUB_OFFLINE is set"
    try:
        huggingface_hub.get_hf_file_metadata(huggingface_hub.hf_hub_url(repo, "tokenizer_config.json"),
                                             timeout=HUB_PROBE_TIMEOUT_S)
    except HfHubHTTPError:   # the hub answered (a missing file or repo): transformers gives its own error
        return None
    except Exception as err:   # no network, DNS, proxy, timeout: whatever the HTTP client raises
        return f"not in the HuggingFace cache, and the hub is not reachable ({type(err).__name__}: {err})"
    return None


def clip_tokenizer(model_name: str, context_length: Optional[int] = None, bert_vocab: Union[str, Path, None] = None,
                   cache_dir: Union[str, Path, None] = None):
    """The tokenizer of an open_clip model name or `local-dir:` export; `bert_vocab` (a folder with
    vocab.txt) replaces the hub for a model whose config names a HuggingFace tokenizer."""
    text_cfg = _text_cfg(model_name)
    hf_name = text_cfg.get("hf_tokenizer_name")
    if bert_vocab is not None and not hf_name:
        raise ValueError(f"a BERT vocabulary ({bert_vocab}) was given but {model_name} uses CLIP's BPE tokenizer; "
                         f"remove it (model.bert_vocab / --bert-vocab) or pick a CLIPA-text model")
    if bert_vocab is None:
        unreachable = _hub_unreachable(hf_name) if hf_name and ":" not in model_name else None
        try:
            if unreachable:
                raise OSError(unreachable)
            return open_clip.get_tokenizer(model_name, context_length=context_length)
        except (OSError, ValueError) as err:
            raise TokenizerUnavailableError(
                f"cannot load the tokenizer {hf_name!r} of {model_name} ({type(err).__name__}: {err}); offline, "
                f"pass a folder holding its vocab.txt: run config model.bert_vocab, CLI --bert-vocab") from err
    ctx = context_length or text_cfg.get("context_length", 32)
    return open_clip.tokenizer.HFTokenizer(str(bert_tokenizer_dir(bert_vocab, cache_dir)), context_length=ctx,
                                           **text_cfg.get("tokenizer_kwargs", {}))


def tokenizer_record(model_name: str, bert_vocab: Union[str, Path, None] = None) -> Dict:
    """What checkpoints and exports record about the tokenizer a model was trained with."""
    text_cfg = _text_cfg(model_name)
    record = {"name": text_cfg.get("hf_tokenizer_name") or "clip-bpe",
              "kwargs": text_cfg.get("tokenizer_kwargs") or {}, "bert_vocab": None, "vocab_sha1": None}
    if bert_vocab is not None:
        path = _vocab_file(bert_vocab)
        record.update(bert_vocab=str(path.parent.resolve()), vocab_sha1=hashlib.sha1(_vocab_bytes(path)).hexdigest())
    return record
