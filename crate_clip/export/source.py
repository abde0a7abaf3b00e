"""What a training checkpoint says about the model to export: which checkpoint, its sizes, tokenizer,
normalisation, the run's stages and the evaluation results its weights have (results.jsonl).

A checkpoint is named as a user has it at hand: the run folder, its `checkpoints/` folder (the checkpoint
`latest` names), one `<tag>/` folder, or a stage number (that stage's last checkpoint), chosen by
crate_clip.checkpoint_io.checkpoint_choice (choose_checkpoint), where train and eval choose theirs; a checkpoint
linked from another run is refused there (its results.jsonl and exports/ would be this run's). Every value
comes from the checkpoint's record (crate_clip.json, read as that module's CheckpointInfo), so an export of it is
the same wherever and whenever it is made.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from crate_clip.checkpoint_io.bounded_reads import UnreadableRecordError, read_small_jsonl
from crate_clip.checkpoint_io.checkpoint_choice import EXPORT, choose_checkpoint
from crate_clip.checkpoint_io.checkpoint_record import INFO_FILE, CheckpointInfo, read_record
from crate_clip.checkpoint_io.run_layout import RESULTS_FILE, run_dir_of
from crate_clip.core.errors import UserError
from crate_clip.models import preprocess_cfg_for
from crate_clip.models.clip_tokenizers import tokenizer_record
from crate_clip.models.model_cfg_check import check_recorded_normalisation


class ExportSourceError(UserError, ValueError):
    """A checkpoint that cannot be exported; the message names the folder and the fix (one line, exit code 2)."""


@dataclass(frozen=True)
class ExportSource:
    """One complete checkpoint and what its export needs."""
    tag_dir: Path
    record: CheckpointInfo   # its crate_clip.json
    bert_vocab: str | None
    results: list = field(default_factory=list)   # results.jsonl rows of the stages up to this checkpoint
    weights: str = "live"    # which weights are exported: the trained ones, or 'ema' (train.ema's average)

    @property
    def run_config(self) -> dict:
        """The run config the checkpoint was trained under (as saved in it)."""
        return self.record.run_config

    @property
    def model_name(self) -> str:
        """The open_clip config name."""
        return self.record.model_name

    @property
    def image_size(self) -> int:
        """The stage's image size."""
        return int(self.record.image_size)

    @property
    def context_length(self) -> int:
        """The stage's text context length."""
        return int(self.record.context_length)

    @property
    def tokenizer_name(self) -> str:
        """The open_clip name whose tokenizer the run used (model.tokenizer, default the model's)."""
        return (self.run_config.get("model") or {}).get("tokenizer") or self.model_name

    @property
    def mean(self) -> list:
        """The image mean the training stream normalised with."""
        return self._normalisation()["mean"]

    @property
    def std(self) -> list:
        """The image std the training stream normalised with."""
        return self._normalisation()["std"]

    def _normalisation(self) -> dict:
        recorded = self.record.normalisation
        if recorded:
            return recorded
        # a checkpoint that does not record it: data.mean / std where they differ from the stream's
        # defaults (then the run config set them), else the model config's, as the trainer chooses
        from crate_clip.data.train_stream import StreamConfig

        data, model = self.run_config.get("data") or {}, preprocess_cfg_for(self.model_name)
        defaults = StreamConfig()
        return {k: list(data[k]) if k in data and tuple(data[k]) != tuple(getattr(defaults, k)) else list(model[k])
                for k in ("mean", "std")}


def export_source(checkpoint: str | Path, stage: int | None = None, bert_vocab: str | None = None,
                  weights: str = "live") -> ExportSource:
    """The checkpoint to export: `checkpoint` is a run folder, its checkpoints folder or one tag folder;
    `stage` picks that stage's last checkpoint. `bert_vocab` stands in for the vocabulary the run recorded.
    `weights`: 'live' (the trained weights) or 'ema' (train.ema's average): the results listed are theirs."""
    tag_dir = choose_checkpoint(checkpoint, EXPORT, stage=stage, error=ExportSourceError).tag_dir
    record = read_record(tag_dir)
    if record is None or record.model_name is None:
        raise ExportSourceError(f"{tag_dir}: {INFO_FILE} missing, unreadable or naming no model (an interrupted "
                                f"save?); pass a complete checkpoint")
    # finite, or the export would hold it (and NaN every image)
    check_recorded_normalisation(record.normalisation, tag_dir / INFO_FILE,
                                 "the checkpoint's record is damaged: export another one")
    vocab = _vocab(record, bert_vocab, tag_dir)
    return ExportSource(tag_dir, record, vocab, _results(tag_dir, record, weights), weights)


def _vocab(checkpoint: CheckpointInfo, bert_vocab: str | None, tag_dir: Path) -> str | None:
    """The BERT vocabulary folder to write the tokenizer from: the given one (which must be the run's), else the
    one the run recorded, when it is still there."""
    record = checkpoint.tokenizer
    if bert_vocab is None:
        recorded = record.get("bert_vocab")
        if recorded and not Path(recorded).is_dir():
            raise ExportSourceError(f"{tag_dir}: the run's BERT vocabulary {recorded} is gone; pass the folder "
                                    f"holding its vocab.txt (--bert-vocab)")
        return recorded
    wanted = record.get("vocab_sha1")
    got = tokenizer_record(checkpoint.model_name, bert_vocab)["vocab_sha1"] if wanted else None
    if wanted and got != wanted:
        raise ExportSourceError(f"--bert-vocab {bert_vocab}: not the vocabulary the run trained with "
                                f"(sha1 {got[:12]} vs {wanted[:12]}); pass that one")
    return str(Path(bert_vocab))


def _results(tag_dir: Path, record: CheckpointInfo, weights: str = "live") -> list[dict]:
    """results.jsonl rows of the stages whose weights end in this checkpoint (the last row per evaluation), of the
    `weights` exported (rows without 'weights' are the live weights'); the file read within MAX_RECORD_BYTES, each
    row checked (_row_problem) before it is used."""
    run_dir = run_dir_of(tag_dir)
    stage, finished = record.progress.stage_index, record.ends_stage
    path = run_dir / RESULTS_FILE
    rows = {}
    try:
        lines = read_small_jsonl(path)
    except UnreadableRecordError as exc:   # too large, not a regular file, a line that is not JSON
        raise ExportSourceError(f"{exc}; the model card lists the run's results from it") from None
    for number, row in lines:
        problem = _row_problem(row)
        if problem:
            raise ExportSourceError(f"{path}:{number}: {problem}: not a result row the trainer writes; fix: remove "
                                    "the line (or move the file away: the card then lists no results)")
        if row.get("weights", "live") != weights:
            continue
        if row.get("stage_index", -1) < stage or (finished and row.get("stage_index") == stage):
            rows[(row.get("stage_index"), row.get("eval"), row.get("image_size"), row.get("resize", "grid"))] = row
    return [rows[k] for k in sorted(rows, key=lambda k: (k[0] or 0, str(k[1]), k[2] or 0, k[3]))]


# the keys of a result row the export reads, and what each must be when present
_ROW_KEYS = {"stage_index": (int,), "image_size": (int,), "eval": (str,), "resize": (str,), "stage_name": (str,),
             "top1": (int, float), "top5": (int, float), "weights": (str,)}


def _row_problem(row) -> str | None:
    """Why a results.jsonl value is not a row the export can use (not an object, a key of another type, a metric
    that is not a finite number), or None."""
    if not isinstance(row, dict):
        return f"{json.dumps(row)[:40]} is not a JSON object"
    for key, types in _ROW_KEYS.items():
        value = row.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, types) or (isinstance(value, float)
                                                                        and not math.isfinite(value)):
            return f"its {key} is {json.dumps(value)[:40]}"
    return None
