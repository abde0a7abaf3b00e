"""`crate-clip inspect text`: a caption's attention per head and its most active dictionary atoms in a CRATE-alpha
text tower, causal (CLIP BPE) and bidirectional (BERT WordPiece, CLIPA's last-position pooling)."""
import json

import open_clip
import pytest
import torch

import crate_clip  # noqa: F401  (registers the configs and the text-tower builder)
from crate_clip.models import bert_text_cfg, bert_tokenizer, create_clip
from crate_clip.eval.inspect_cli import main as inspect_main
from crate_clip.eval.whitebox_text import format_inspection, inspect_caption

TINY_TEXT = "CRATE-alpha-CLIPA-tiny-crate-text"
CAPTION = "a photo of a sandal"


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return create_clip(TINY_TEXT).eval()


def check_rows_and_atoms(ins, clip, ids):
    """Each attention row (shown tokens + padding column) sums to 1; the atoms are the code's largest entries."""
    for head in ins.attention:
        for row in head:
            assert abs(sum(row) - 1) < 1e-5 and min(row) >= 0
    with torch.no_grad():
        codes = clip.text.forward_intermediates(ids, intermediates_only=True,
                                                return_sparse_codes=True)["text_sparse_codes"][ins.layer][0]
    for pos, atoms, active in zip(ins.positions, ins.atoms, ins.active_atoms):
        code = codes[pos]
        assert atoms[0] == (int(code.argmax()), pytest.approx(float(code.max())))
        assert active == int((code != 0).sum()) and 0 < active < ins.code_dim   # sparse, not empty


def test_causal_caption(tiny):
    tokenizer = open_clip.get_tokenizer(TINY_TEXT)
    ins = inspect_caption(tiny, tokenizer, CAPTION, layer=-1, top_atoms=4)
    assert ins.tokens == ["<sot>", "a", "photo", "of", "a", "sandal", "<eot>"] and ins.positions == list(range(7))
    assert ins.pooled == 6 and ins.causal and ins.layer == 1 and len(ins.attention) == 2   # 2 heads
    for head in ins.attention:   # nothing above the diagonal, nothing on the padding after <eot>
        assert all(head[i][j] == 0 for i in range(7) for j in range(i + 1, 8))
    assert all(len(a) == 4 for a in ins.atoms) and len(ins.coding_rate) == len(ins.zero_fraction) == 2
    check_rows_and_atoms(ins, tiny, tokenizer([CAPTION]))
    text = format_inspection(ins)
    assert "head 1:" in text and "sandal" in text and "<eot>*" in text and "#" in text


def test_bidirectional_caption_shows_the_pooled_padding_slot(tmp_path):
    words = ["a", "photo", "of", "sandal", "shoe"]
    (tmp_path / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + words) + "\n")
    torch.manual_seed(0)
    clip = create_clip(TINY_TEXT, context_length=12, text_cfg=bert_text_cfg(tmp_path)).eval()
    tokenizer = bert_tokenizer(tmp_path, context_length=12)
    ins = inspect_caption(clip, tokenizer, CAPTION, layer=0)
    assert not ins.causal and ins.tokens == ["[CLS]", "a", "photo", "of", "a", "sandal", "[PAD]"]
    assert ins.positions[-1] == 11 and ins.pooled == 6   # CLIPA's 'last' reads a padding position
    assert all(row[-1] > 0 for head in ins.attention for row in head)   # bidirectional: mass on the padding too
    check_rows_and_atoms(ins, clip, tokenizer([CAPTION]))


def test_cli_json_and_errors(capsys, tmp_path):
    assert inspect_main(["text", CAPTION, "--model", TINY_TEXT, "--layer", "0", "--json", "--out", str(tmp_path)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tokens"][-2:] == ["sandal", "<eot>"] and out["layer"] == 0
    assert (tmp_path / "text_attention_block0.png").stat().st_size > 1000
    assert inspect_main(["text", CAPTION, "--model", "CRATE-alpha-CLIPA-tiny"]) == 2
    assert "no CRATE-alpha text tower" in capsys.readouterr().err
    assert inspect_main(["text", CAPTION, "--model", TINY_TEXT, "--layer", "5"]) == 2
    assert "has 2 blocks" in capsys.readouterr().err


def test_text_layer_diagnostics_are_the_per_caption_numbers_averaged(tiny):
    """The training probe's per-block numbers over a batch of captions of different lengths: the mean and std of
    what `inspect text` reports for each caption over its own tokens."""
    from crate_clip.eval.whitebox_text import text_layer_diagnostics

    tokenizer = open_clip.get_tokenizer(TINY_TEXT)
    captions = [CAPTION, "a bag", "a photo of a pair of trousers, folded"]
    d = text_layer_diagnostics(tiny, tokenizer(captions))
    single = [inspect_caption(tiny, tokenizer, c) for c in captions]
    # rel 1e-5: the float32 forward of a batch of 3 and of one caption run matmuls of other shapes
    for block in range(2):
        rates = torch.tensor([s.coding_rate[block] for s in single], dtype=torch.float64)
        zeros = torch.tensor([s.zero_fraction[block] for s in single], dtype=torch.float64)
        assert d["coding_rate"][block] == pytest.approx(float(rates.mean()), rel=1e-5)
        assert d["coding_rate_std"][block] == pytest.approx(float(rates.std(unbiased=False)), rel=1e-5)
        assert d["zero_fraction"][block] == pytest.approx(float(zeros.mean()), abs=1e-6)
        assert d["l0"][block] == pytest.approx(1 - d["zero_fraction"][block])
    with pytest.raises(TypeError, match="no CRATE-alpha text tower"):
        text_layer_diagnostics(create_clip("CRATE-alpha-CLIPA-tiny"), tokenizer(captions))
