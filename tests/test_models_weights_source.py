"""crate_clip.models.weights_source, the one parser of a weights-source string (create_clip's pretrained,
model.text_pretrained, eval's --model / --pretrained): each form its table lists is read as its kind, and the
callers accept and refuse the kinds as before."""
import pytest

from crate_clip.models.export_files import CONFIG_FILE, WEIGHTS_FILES
from crate_clip.models.text_sources import TextTowerError, check_text_source, resolve_text_source
from crate_clip.models.weights_source import (CHECKPOINT, EXPORT, FILE, HF_HUB_KIND, LOCAL_DIR_KIND, NAME, OPEN_CLIP,
                                              parse_weights_source)


def test_each_form_is_read_as_its_kind_and_the_text_tower_takes_the_kinds_it_took(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    weights = tmp_path / "w.pt"
    weights.write_bytes(b"")
    ckpts = tmp_path / "run" / "checkpoints"
    (ckpts / "stage0-step00000001").mkdir(parents=True)
    (ckpts / "stage0-step00000001" / "mp_rank_00_model_states.pt").write_bytes(b"")
    (ckpts / "latest").write_text("stage0-step00000001")
    export = tmp_path / "export"
    export.mkdir()
    (export / CONFIG_FILE).write_text("{}")
    (export / WEIGHTS_FILES[0]).write_bytes(b"")
    (tmp_path / "ViT-B-32:openai").write_bytes(b"")   # a file named like open_clip's MODEL:TAG: the file is meant

    kinds = {spec: parse_weights_source(spec) for spec in (
        str(weights), "~/w.pt", str(ckpts), str(ckpts / "stage0-step00000001"), str(export), f"local-dir:{export}",
        "local-dir:~/export", "hf-hub:org/repo", "ViT-B-16:openai", "ViT-B-32:openai", "CRATE-alpha-CLIPA-B-16",
        str(tmp_path / "gone.pt"))}
    assert {spec: s.kind for spec, s in kinds.items()} == {
        str(weights): FILE, "~/w.pt": FILE, str(ckpts): CHECKPOINT, str(ckpts / "stage0-step00000001"): CHECKPOINT,
        str(export): EXPORT, f"local-dir:{export}": LOCAL_DIR_KIND, "local-dir:~/export": LOCAL_DIR_KIND,
        "hf-hub:org/repo": HF_HUB_KIND, "ViT-B-16:openai": OPEN_CLIP, "ViT-B-32:openai": FILE,
        "CRATE-alpha-CLIPA-B-16": NAME, str(tmp_path / "gone.pt"): NAME}
    assert kinds["~/w.pt"].path == weights and kinds["local-dir:~/export"].path == export   # `~` expanded everywhere
    assert (kinds["ViT-B-16:openai"].name, kinds["ViT-B-16:openai"].tag) == ("ViT-B-16", "openai")
    assert kinds["hf-hub:org/repo"].name == "org/repo"

    # model.text_pretrained: a file, a checkpoint folder and local-dir: are read; a bare export folder is not
    assert resolve_text_source(str(weights)) == weights
    assert resolve_text_source(str(ckpts)) == ckpts
    assert resolve_text_source(f"local-dir:{export}") == export / WEIGHTS_FILES[0]
    with pytest.raises(TextTowerError, match="is not a file, local-dir:DIR, hf-hub:ORG/REPO"):
        resolve_text_source(str(export))
    assert check_text_source("local-dir:") == "model.text_pretrained: 'local-dir:' names nothing after the prefix"
    assert "has no pretrained tag 'nope'" in check_text_source("ViT-B-16:nope")
