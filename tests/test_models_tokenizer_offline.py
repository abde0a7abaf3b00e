"""`clip_tokenizer` of a hub-tokenized CLIPA model fails at once with its clear error when the hub cannot be
reached, with HF_HUB_OFFLINE=1 and also without it (this machine has no hub access: transformers alone retries
for tens of seconds), and still loads a tokenizer that is in the HuggingFace cache."""
import json
import sys
from pathlib import Path

import pytest

import warm_python
from train_fixtures import run_env

from crate_clip.models.clip_tokenizers import BERT_TOKENIZER_CONFIG

SHARED_VOCAB = Path(__file__).resolve().parents[2] / "shared" / "bert_base_uncased" / "vocab.txt"
PROGRAM = """
import time
from crate_clip.models import clip_tokenizer
start = time.monotonic()
try:
    tok = clip_tokenizer("CRATE-alpha-CLIPA-B-16")
    print("LOADED", tok(["a photo of a cat"])[0][:4].tolist())
except Exception as err:
    print(type(err).__name__, err)
print("SECONDS", time.monotonic() - start)
"""


def _run(tmp_path: Path, offline: bool) -> tuple[str, float]:
    env = {k: v for k, v in run_env().items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env.update(HF_HOME=str(tmp_path / "hf_home"), **({"HF_HUB_OFFLINE": "1"} if offline else {}))
    # forked from the interpreter that imported torch alone (HF_HUB_OFFLINE is read by huggingface_hub's import,
    # which comes after, in the command)
    done = warm_python.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, env=env, timeout=600,
                           base="torch")
    assert done.returncode == 0, done.stderr[-2000:]
    head, seconds = done.stdout.rsplit("SECONDS", 1)
    return head.strip(), float(seconds)


@pytest.mark.parametrize("offline", [True, False], ids=["HF_HUB_OFFLINE=1", "no-network"])
def test_unreachable_hub_fails_at_once_with_the_fix(offline, tmp_path):
    out, seconds = _run(tmp_path, offline)
    assert out.startswith("TokenizerUnavailableError") and "bert-base-uncased" in out and "--bert-vocab" in out, out
    if not offline and "not reachable" not in out:
        pytest.skip(f"the hub answered here, so it is not an offline check: {out}")
    # no retry loop: transformers' own retries wait 30-50 s; the bound leaves room for its import on a loaded machine
    assert seconds < 20, f"{seconds:.1f} s before the error"


@pytest.mark.skipif(not SHARED_VOCAB.is_file(), reason="../shared/bert_base_uncased/vocab.txt is not here")
def test_tokenizer_in_the_hf_cache_still_loads_offline(tmp_path):
    """The HuggingFace cache layout (models--<repo>/refs/main -> snapshots/<commit>/) with BERT's vocabulary."""
    repo = tmp_path / "hf_home" / "hub" / "models--bert-base-uncased"
    commit = "0" * 40
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    (snapshot / "vocab.txt").write_bytes(SHARED_VOCAB.read_bytes())
    (snapshot / "tokenizer_config.json").write_text(json.dumps(BERT_TOKENIZER_CONFIG))
    (snapshot / "config.json").write_text(json.dumps({"model_type": "bert"}))   # AutoTokenizer reads it too
    out, _ = _run(tmp_path, offline=True)
    assert out.startswith("LOADED [101,"), out   # [CLS] first
