"""The run configuration: typed sections loaded from one YAML file, `--set` overrides, validation.

Every error names the offending key (dotted path, e.g. `stages.1.lr`) and says how to fix it, and all
errors of a file are reported at once, before any process group, model or data stream exists.
"""
from __future__ import annotations

import copy
import importlib
import tarfile
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, Union, get_args

from pydantic import Field, PrivateAttr, ValidationError

from crate_clip.checkpoint_io.weights_headers import WeightsHeaderError, stored_values
from crate_clip.core.errors import ConfigError
from crate_clip.core.user_text import cut
from crate_clip.core.config_schema import Bool, Float, Int, Section, error_lines
from crate_clip.core.file_kinds import special_file
from crate_clip.core.safe_yaml import load_yaml, load_yaml_file
from crate_clip.core.patch_tiling import grid_tiling_problem, patch_tiling_problem, tiling_sizes
from crate_clip.models.model_patch_size import image_patch_size
from crate_clip.models.pos_embed import POS_EMBED_RESIZE_MODES
from crate_clip.models.export_files import LOCAL_DIR
from crate_clip.models.weights_source import LOCAL_DIR_KIND, parse_weights_source
from crate_clip.models.token_masks import TokenMask
from crate_clip.data.device_decode import Decode
from crate_clip.core.shard_sources import TooManyShardsError, check_shard_count, pattern_count, refused_source
from crate_clip.data.shard_census import tar_ending
from crate_clip.data.shard_reader import ShardListError, expand_source, is_remote
from crate_clip.core.tar_members import COMPRESSED_MAGIC
from crate_clip.data.text_reduction import TextMask
from crate_clip.data.train_stream import StreamConfig, crop_scale_problems
from crate_clip.eval.registry import EvalSpec, data_problems
from crate_clip.train.run.run_dir import output_dir_problems

Precision = Literal["bf16", "fp16", "fp32"]
# scaled_dot_product_attention kernel: 'auto' = the math kernel on CPU (its backward is several times
# faster than the CPU flash kernel's for short sequences), torch's choice on GPU
AttentionKernel = Literal["auto", "math", "flash", "efficient", "default"]
PRECISIONS = get_args(Precision)
# Bounds of sizes a config may ask for (docs/safety.md): each far above any real run, each far below a size that
# would take the machine's memory before the first step (a 10^9 px image side, a 10^9-token position embedding)
MAX_SEED = 2 ** 32 - 1          # numpy's seeds are 32-bit; torch's take it as it is
MAX_IMAGE_SIZE = 4096           # pixels a side (the papers train at 224-336, fine-tune up to 1024)
MAX_CONTEXT_LENGTH = 4096       # text tokens (CLIPA: 8-32, open_clip: 77, BERT towers: 512)
MAX_PROBE_IMAGES = 4096         # the white-box diagnostics' probe batch (default 64)


class RunSection(Section):
    """Where the run writes, its seed, and when it gives up on non-finite losses."""
    name: str = Field("run", description="the run's name")
    output_dir: str = Field("runs/run", description="where the run writes: checkpoints, metrics, results, plot, "
                                                   "export")
    seed: Int = Field(0, ge=0, le=MAX_SEED, description="seed of the initial weights and of the data order (each "
                                                        "stage draws its own stream seed from it)")
    max_nonfinite_in_a_row: Int = Field(5, ge=1, description="non-finite steps in a row that stop the run (a few "
                                                             "skipped steps in a row are normal in fp16)")
    lost_rank_timeout_s: Float = Field(120.0, ge=5, le=86400, description="seconds without a sign of life from "
                                       "another rank (its node crashed, its network went) before the job ends with "
                                       "exit 9, instead of waiting out the process group's 30-minute timeout")


class ModelSection(Section):
    """Which open_clip model config to build (any registered name, e.g. CRATE-alpha-CLIPA-L-14)."""
    name: str = Field("CRATE-alpha-CLIPA-tiny", description="any registered open_clip model name")
    pretrained: Optional[str] = Field(None, description="weights file or checkpoint folder for the first stage (resized to its shapes)")
    tokenizer: Optional[str] = Field(None, description="open_clip tokenizer / model name; default: model.name")
    grad_checkpointing: Bool = Field(False, description="recompute each block in the backward: less activation "
                                                        "memory, more compute")
    attention: AttentionKernel = Field("auto", description="scaled_dot_product_attention kernel: auto = math on "
                                                           "CPU, torch's choice on GPU")
    compile: Bool = Field(False, description="torch.compile the image and text towers (Module.compile: same keys)")
    pos_embed_resize: Literal[POS_EMBED_RESIZE_MODES] = Field(
        "grid_2d", description="how carried weights' image position embeddings are resized at a stage change (and "
                               "for the full-size eval of a low-res stage): official_1d (the CRATE-alpha CLIPA code) "
                               "or grid_2d")
    bert_vocab: Optional[str] = Field(None, description="folder with vocab.txt: the BERT tokenizer without the "
                                                        "HuggingFace hub")
    text_pretrained: Optional[str] = Field(None, description="copy the text tower (and logit scale) from a CLIPA "
                                                             "checkpoint, the paper's setup: a weights file, a "
                                                             "checkpoint folder, local-dir:DIR, hf-hub:ORG/REPO or "
                                                             "open_clip's MODEL:TAG "
                                                             "(e.g. ViT-H-14-CLIPA:datacomp1b)")
    lock_text: Bool = Field(False, description="freeze the text tower: no gradients, no optimizer state, "
                                               "replicated (not ZeRO-partitioned)")
    lock_logit_scale: Bool = Field(False, description="the temperature stays as created / copied from "
                                                      "text_pretrained")

    def checks(self) -> list[tuple[str, str]]:
        """text_pretrained names a usable source; a locked text tower starts from pretrained weights."""
        problems = []
        if self.text_pretrained:
            # text_sources imports open_clip and the CLIP build: only a config that names a text tower pays for it
            from crate_clip.models.text_sources import check_text_source

            error = check_text_source(self.text_pretrained)
            if error:
                problems.append(("text_pretrained", error.split(": ", 1)[1]))
        if self.lock_text and not (self.text_pretrained or self.pretrained):
            problems.append(("lock_text", "true would freeze a randomly initialised text tower; fix: set "
                                          "model.text_pretrained (e.g. ViT-H-14-CLIPA:datacomp1b or a file) or "
                                          "model.pretrained, or lock_text: false"))
        return problems


class StageConfig(Section):
    """One training stage: token budget (image size, text length, masks), batch, samples and LR schedule."""
    name: str = Field("stage", description="the stage's name (checkpoint tags, logs); unique in the run")
    image_size: Int = Field(224, le=MAX_IMAGE_SIZE, description="image side in pixels")
    context_length: Int = Field(32, ge=2, le=MAX_CONTEXT_LENGTH, description="text tokens, e.g. 32")
    samples: Int = Field(0, description="training samples of the stage (rounded down to whole global batches, "
                                        "said by --validate and at the start of training)")
    global_batch: Int = Field(256, ge=2, description="the contrastive batch over all ranks; a contrastive batch "
                                                     "needs >= 2 samples")
    lr: Float = Field(1e-3, description="peak learning rate: linear warm-up to it, then cosine decay to min_lr")
    warmup_steps: Int = Field(0, description="optimizer steps of linear learning-rate warm-up")
    weight_decay: Float = Field(0.2, ge=0, description="AdamW's decoupled weight decay of the matrix kernels "
                                                       "(biases, norms and the like are not decayed)")
    min_lr: Float = Field(0.0, description="the learning rate the cosine decay ends at, between 0 and lr")
    text_mask: TextMask = Field("truncate", description="how captions are reduced to context_length (CLIPA)")
    image_mask: TokenMask = Field("none", description="which patch tokens the image tower drops in training")
    image_mask_ratio: Float = Field(0.0, ge=0, lt=1, description="the share of patch tokens dropped, in [0, 1)")
    crop_scale: Optional[tuple[Float, Float]] = Field(None, description="random-resized-crop area range; default: "
                                                                        "data.crop_scale")
    patch_size: Optional[Int] = Field(None, ge=1, description="the image tower's patch side in pixels from this "
                                                              "stage on, up to image_size (default: the previous "
                                                              "stage's, else the model config's)")
    patch_resize: Literal["pi_resize", "bilinear"] = Field("pi_resize", description="how a patch-size change "
                                                           "resizes the kernel: pi_resize (FlexiViT) or bilinear "
                                                           "(the CRATE-alpha paper)")
    micro_batch: Optional[Union[Literal["auto"], Annotated[int, Field(ge=1)]]] = Field(
        None, description="per-rank micro-batch: an int, or auto (the planner's largest that fits); default "
                          "global_batch / world. k = global_batch / (micro_batch x world) accumulation steps with "
                          "exact contrastive gradients")
    checkpoint_blocks: Optional[Int] = Field(
        None, ge=0, description="image-tower blocks recomputed in the backward in this stage, from the first (0: "
        "none, in either tower; the tower's depth: all), the text tower's too under model.grad_checkpointing; "
        "default: every block of "
        "both towers with model.grad_checkpointing, none without. `crate-clip plan --tune` picks the fewest that "
        "fit (CRATE-alpha towers)")
    optimizer_state: Literal["fresh", "carry"] = Field(
        "fresh", description="the AdamW state the stage starts from: fresh (zero moments, step 0) or carry (the "
                             "previous stage's moments and step count; a parameter whose shape changes at the "
                             "boundary, such as a resized patch kernel or a grown position embedding, starts from "
                             "zero moments; ZeRO stage 1 or 2, or 0 in fp32)")
    decode: Decode = Field("cpu", description="where JPEGs are decoded: cpu (loader workers) or device (workers draw "
                                              "the crops and ship the bytes; batched decode + crop/resize/normalise "
                                              "on the training device; same crops and seeds)")

    @property
    def steps(self) -> int:
        """Optimizer steps in this stage (samples rounded down to whole global batches)."""
        return self.samples // self.global_batch

    @property
    def trained_samples(self) -> int:
        """The samples the stage trains: its steps times global_batch (what progress.samples_seen counts)."""
        return self.steps * self.global_batch

    def rounding_note(self, key: str) -> Optional[str]:
        """The line that says samples were rounded down to whole global batches (None when they are whole)."""
        if self.samples % self.global_batch == 0:
            return None
        return (f"{key}.samples: {self.samples:,} is not a multiple of global_batch {self.global_batch:,}: the "
                f"stage trains {self.steps:,} steps = {self.trained_samples:,} samples (rounded down); set samples "
                f"to {self.trained_samples:,} or {self.trained_samples + self.global_batch:,} to have the config "
                "say so")

    def checks(self) -> list[tuple[str, str]]:
        """Problems that involve more than one key, each with its fix."""
        problems = crop_scale_problems("crop_scale", self.crop_scale)
        if self.image_size < 1:
            problems.append(("image_size", f"{self.image_size}; fix: a positive size in pixels (e.g. 84)"))
        if self.samples < self.global_batch:
            problems.append(("samples", f"{self.samples} is less than one global batch ({self.global_batch}); "
                                        "fix: raise samples or lower global_batch"))
        if self.lr <= 0:
            problems.append(("lr", f"{self.lr}; fix: a positive peak learning rate, e.g. 1e-3"))
        elif not 0 <= self.min_lr <= self.lr:
            problems.append(("min_lr", f"{self.min_lr}; fix: between 0 and lr ({self.lr})"))
        if not 0 <= self.warmup_steps < max(self.steps, 1):
            problems.append(("warmup_steps", f"{self.warmup_steps} but the stage has {self.steps} steps "
                                             "(samples / global_batch); fix: fewer warm-up steps or more samples"))
        if self.patch_size is not None and self.patch_size > self.image_size:
            problems.append(("patch_size", f"{self.patch_size}; fix: a patch side in pixels up to image_size "
                                           f"({self.image_size}), or remove it"))
        if self.image_mask not in ("none", "grid") and self.image_mask_ratio == 0:
            problems.append(("image_mask_ratio", f"0 with image_mask {self.image_mask!r}; fix: set a ratio such "
                                                 "as 0.3, or image_mask: none"))
        return problems


class OptimizerSection(Section):
    """AdamW with decoupled weight decay (per-stage decay and LR live in the stages)."""
    betas: list[Float] = Field([0.9, 0.95], description="AdamW's two betas, each in [0, 1)")
    eps: Float = Field(1e-6, gt=0, description="AdamW's epsilon")
    grad_clip: Float = Field(1.0, ge=0, description="gradient-norm clipping; 0 = no clipping")

    def checks(self) -> list[tuple[str, str]]:
        """Two betas in [0, 1)."""
        if len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas):
            return []
        return [("betas", f"{self.betas}; fix: two numbers in [0, 1), e.g. [0.9, 0.95]")]


class DeepSpeedSection(Section):
    """ZeRO stage and settings: a JSON/YAML file from configs/deepspeed/ plus inline overrides."""
    zero_stage: Optional[Int] = Field(None, description="0, 1, 2 or 3; default: the file's "
                                                        "zero_optimization.stage, else 1")
    config: Optional[str] = Field(None, description="a DeepSpeed JSON / YAML file, e.g. configs/deepspeed/zero2.json "
                                                    "(relative: to the run config)")
    overrides: dict[str, Any] = Field({}, description="DeepSpeed config keys merged over the file's")

    def checks(self) -> list[tuple[str, str]]:
        """A ZeRO stage DeepSpeed has."""
        if self.zero_stage in (None, 0, 1, 2, 3):
            return []
        return [("zero_stage", f"{self.zero_stage!r}; fix: use 0, 1, 2 or 3")]


class CheckpointSection(Section):
    """Checkpoint cadence (every N steps, plus every stage end) and how many to keep."""
    every_steps: Int = Field(0, ge=0, description="a checkpoint every N steps, and at every stage end; 0 = only "
                                                  "at stage ends")
    keep_last: Int = Field(3, ge=1, description="newest checkpoints kept, and each finished stage's last one")


class EvalSection(Section):
    """Evaluations run on all ranks after every stage; low-res stages are also evaluated at full size."""
    after_each_stage: Bool = Field(True, description="run the evaluations after every stage")
    full_image_size: Optional[Int] = Field(None, ge=1, le=MAX_IMAGE_SIZE, description="the size in pixels a low-res "
                                           "stage is also evaluated at; default: the last stage's")
    evals: list[EvalSpec] = Field([], description="each entry: one task of eval/tasks/ with its own settings")
    every_samples: Int = Field(0, ge=0, description="also run the evaluations during a stage, at its own image "
                               "size, each time this many more samples are seen (0 = only at stage ends)")
    every_steps: Int = Field(0, ge=0, description="the same in steps of the stage (0 = off; with every_samples, "
                             "whichever comes first)")
    max_time_share: Float = Field(0.05, gt=0, le=1, description="a mid-stage evaluation is deferred while the "
                                  "evaluations would take more than this share of the training time (said once)")


class LoggingSection(Section):
    """Console progress, trackers (TensorBoard, Weights & Biases, CSV), metrics.jsonl cadence, the final PNG plot."""
    every_steps: Int = Field(10, ge=1, description="a metrics.jsonl / TensorBoard row every N steps")
    progress: Bool = Field(True, description="the console progress: a bar on a terminal, else a line every "
                           "progress_every_s seconds (rank 0 only)")
    progress_every_s: Float = Field(30.0, gt=0, description="seconds between two progress lines when the console "
                                    "is not a terminal (a Slurm log, CI)")
    tensorboard: Bool = Field(True, description="TensorBoard events in tensorboard/ (false drops it from report_to)")
    report_to: list[Literal["tensorboard", "wandb", "csv"]] = Field(
        ["tensorboard"], description="the trackers: tensorboard (tensorboard/), wandb (Weights & Biases; "
        "WANDB_MODE=offline writes wandb/ only), csv (metrics.csv, results.csv)")
    wandb_project: Optional[str] = Field(None, description="the Weights & Biases project (default: crate-clip); "
                                         "the run is named after run.name")
    plot: Bool = Field(True, description="training_curve.png at the end")
    diagnostics_every: Int = Field(0, ge=0, description="white-box coding rate / sparsity per layer every N "
                                   "steps (0 = off)")
    diagnostics_images: Int = Field(64, ge=1, le=MAX_PROBE_IMAGES, description="probe batch: this many images of "
                                    "eval.evals[0] (and as many of its class-name prompts for a CRATE-alpha text "
                                    "tower)")


class EmaSection(Section):
    """An exponential moving average of the trained weights, kept beside them (on rank 0, fp32) and evaluated and
    exportable beside them (`crate-clip export --weights ema`). It restarts in each stage (a stage may change the
    weights' shapes: patch size, position embeddings)."""
    decay: Optional[Float] = Field(None, gt=0, lt=1, description="the weight the average keeps of itself at each "
                                   "update: ema = decay x ema + (1 - decay) x weights, about 1 / (1 - decay) updates "
                                   "of memory (e.g. 0.999); null: no EMA")
    every_steps: Int = Field(1, ge=1, description="an update every N optimizer steps (the memory in steps is "
                             "every_steps / (1 - decay))")
    start_step: Int = Field(0, ge=0, description="the step of each stage at which the average starts as a copy of "
                            "the weights (0: the stage's starting weights); the updates follow every every_steps "
                            "steps")

    @property
    def on(self) -> bool:
        """Whether the run keeps an EMA of its weights."""
        return self.decay is not None


class TrainSection(Section):
    """What the training keeps beside the trained weights."""
    ema: EmaSection = EmaSection()


class RunConfig(Section):
    """A whole run: model, data, stages, optimizer, precision, DeepSpeed, checkpoints, eval, logging."""
    run: RunSection = RunSection()
    model: ModelSection = ModelSection()
    data: StreamConfig = Field(default_factory=dict, validate_default=True,
                               description="the stream's own schema (crate_clip.data.train_stream.StreamConfig)")
    stages: list[StageConfig] = Field([], description="the training stages, in order")
    optimizer: OptimizerSection = OptimizerSection()
    train: TrainSection = TrainSection()
    precision: Precision = Field("bf16", description="bf16 / fp16 / fp32 (on CPU: bf16 or fp32)")
    deepspeed: DeepSpeedSection = DeepSpeedSection()
    checkpoint: CheckpointSection = CheckpointSection()
    eval: EvalSection = EvalSection()
    logging: LoggingSection = LoggingSection()
    _source_path: Optional[str] = PrivateAttr(None)

    @property
    def source_path(self) -> Optional[str]:
        """The YAML file it came from (None when built from a dict)."""
        return self._source_path

    @property
    def run_dir(self) -> Path:
        """The run's output folder."""
        return Path(self.run.output_dir)

    def patch_size_at(self, stage_index: int) -> Optional[int]:
        """The image tower's patch size in a stage: the last one set up to it (None: the model config's)."""
        return next((s.patch_size for s in reversed(self.stages[:stage_index + 1]) if s.patch_size), None)

    @property
    def full_image_size(self) -> int:
        """The resolution a low-res stage is additionally evaluated at."""
        return self.eval.full_image_size or self.stages[-1].image_size

    def stream_config(self, stage_index: int) -> StreamConfig:
        """The data stream's settings for one stage: its own seed, and its crop range if it has one."""
        stage = self.stages[stage_index]
        return self.data.model_copy(update={"seed": self.run.seed + 1009 * stage_index,  # a new order per stage
                                            "crop_scale": stage.crop_scale or self.data.crop_scale})

    def _patch_problems(self) -> list[tuple[str, str]]:
        """Every image size must hold at least one patch of the image tower at that stage's patch size, and the
        patches must tile it (pixels in, pixels used: crate_clip.core.patch_tiling)."""
        native = image_patch_size(self.model.name)
        sizes = [(f"stages.{i}.image_size", s.image_size, self.patch_size_at(i) or native)
                 for i, s in enumerate(self.stages)]
        if self.eval.full_image_size:
            sizes.append(("eval.full_image_size", self.eval.full_image_size, self.patch_size_at(len(self.stages) - 1)
                          or native))
        small = [(key, f"{size} px is smaller than one {patch} px patch of {self.model.name}; fix: at least "
                       f"{patch} (a multiple of {patch})") for key, size, patch in sizes if patch and size < patch]
        untiled = [(f"stages.{i}", problem) for i, (_, size, patch) in enumerate(sizes[:len(self.stages)])
                   if (problem := patch_tiling_problem(size, patch))]
        return small + untiled + self._full_size_eval_problems()

    def _full_size_eval_problems(self) -> list[tuple[str, str]]:
        """A stage evaluated at eval.full_image_size (another size than its own) needs a way there that every
        pixel reaches: its patches tile the full size (resize 'grid') or its patch grid does (resize 'patch')."""
        full, native = (self.full_image_size if self.stages else None), image_patch_size(self.model.name)
        if not (full and self.eval.after_each_stage and self.eval.evals):
            return []
        problems = []
        for i, s in enumerate(self.stages):
            patch = self.patch_size_at(i) or native
            if not patch or s.image_size == full or s.image_size % patch or full < patch:
                continue   # no full-size evaluation, or the stage's own size is refused above
            grid = s.image_size // patch
            if patch_tiling_problem(full, patch) and grid_tiling_problem(full, grid):
                near = sorted(sorted(set(tiling_sizes(full, patch) + tiling_sizes(full, grid)),
                                     key=lambda n: abs(n - full))[:2])
                problems.append(("eval.full_image_size", f"{full} is a multiple neither of stages.{i}'s patch_size "
                                 f"{patch} (resize grid) nor of its {grid}x{grid} patch grid (resize patch), so its "
                                 f"full-size evaluation would drop pixels; use {' or '.join(map(str, near))}"))
        return problems

    def _text_lock_problems(self) -> list[tuple[str, str]]:
        """A locked text tower keeps its position embedding: one context_length in every stage."""
        if not (self.model.lock_text and self.stages):
            return []
        first = self.stages[0].context_length
        return [(f"stages.{i}.context_length", f"{s.context_length}, but stages.0 has {first}; a locked text tower "
                 "(model.lock_text) keeps its position embedding; fix: one context_length in every stage (the text "
                 "checkpoint's, e.g. 32), or model.lock_text: false")
                for i, s in enumerate(self.stages) if s.context_length != first]

    def _ema_problems(self) -> list[tuple[str, str]]:
        """train.ema starts within every stage: a stage that ends before start_step would have no EMA to evaluate
        or export."""
        ema = self.train.ema
        short = [(i, s.steps) for i, s in enumerate(self.stages) if ema.on and s.steps <= ema.start_step]
        if not short:
            return []
        i, steps = short[0]
        return [("train.ema.start_step", f"{ema.start_step}, but stages.{i} has {steps} steps (the EMA restarts in "
                                         f"each stage); fix: a start_step below {min(s for _, s in short)}")]

    def training_plan(self) -> list[str]:
        """What training will do, stage by stage: the steps and samples it runs (StageConfig.steps and
        trained_samples, the numbers the trainer counts), then a line for each stage whose samples are rounded."""
        lines = [f"stage {i} ({s.name}): {s.image_size} px, {s.context_length} tokens, {s.steps:,} steps x "
                 f"{s.global_batch:,} = {s.trained_samples:,} samples" for i, s in enumerate(self.stages)]
        return lines + self.rounding_notes()

    def rounding_notes(self) -> list[str]:
        """A line for each stage whose samples are not whole global batches (they are rounded down)."""
        return [note for i, s in enumerate(self.stages) if (note := s.rounding_note(f"stages.{i}"))]

    def to_dict(self, stream=None) -> dict:
        """Plain-dict form (for the copy saved in the run folder and in checkpoints); with `stream` (the StreamSettings
        a launch settled), data.canonical_streams and data.shuffle_buffer as settled: what a resume reads back."""
        raw = self.model_dump(mode="json", exclude={"data": {"seed"}})  # set per stage from run.seed
        if stream is not None:
            raw["data"].update(canonical_streams=stream.streams, shuffle_buffer=stream.shuffle_buffer)
        return raw

    def checks(self) -> list[tuple[str, str]]:
        """At least one stage, unique stage names; the stream seed comes from run.seed."""
        problems = []
        if not self.stages:
            problems.append(("stages", "empty; fix: give at least one stage (image_size, context_length, "
                                       "samples, global_batch, lr)"))
        names = [s.name for s in self.stages]
        if len(set(names)) != len(names):
            problems.append(("stages", f"duplicate stage names {names}; fix: give each a unique name"))
        problems += self._patch_problems()
        problems += self._text_lock_problems()
        if self.stages and self.stages[0].optimizer_state == "carry":
            problems.append(("stages.0.optimizer_state", "carry, but no stage comes before it; fix: fresh"))
        if self.logging.diagnostics_every and not self.eval.evals:
            problems.append(("logging.diagnostics_every", "the probe batch comes from eval.evals[0]; fix: declare "
                                                          "an eval set or set it to 0"))
        problems += self._ema_problems()
        if "seed" in self.data.model_fields_set:
            problems.append(("data.seed", "set per stage from run.seed; fix: remove it and set run.seed"))
        return problems


# ---------------------------------------------------------------- overrides
MAX_SET_KEY_PARTS = 16   # the deepest real key (deepspeed.overrides.zero_optimization.offload_optimizer.device) has 5


def apply_override(raw: dict, assignment: str) -> None:
    """Apply one `a.b.0.c=value` override (value parsed as YAML) to the raw config dict in place."""
    if "=" not in assignment:
        raise ConfigError(f"--set {assignment!r}: expected KEY=VALUE, e.g. --set stages.0.lr=1e-3")
    path, text = assignment.split("=", 1)
    parts = [p for p in path.strip().split(".") if p]
    if not parts:
        raise ConfigError(f"--set {assignment!r}: empty key")
    if len(parts) > MAX_SET_KEY_PARTS:   # no key is that deep; thousands of levels would exhaust the recursion later
        raise ConfigError(f"--set {cut(path.strip(), 60)}: a key of {len(parts):,} parts, more than the "
                          f"{MAX_SET_KEY_PARTS} any run-config key has; fix: a key such as stages.0.lr")
    value = load_yaml(text, f"--set {path.strip()}") if text.strip() else None
    node: Any = raw
    for depth, part in enumerate(parts):
        last = depth == len(parts) - 1
        where = ".".join(parts[: depth + 1])
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise ConfigError(f"--set {path}: '{where}' is not an index of a list of {len(node)} "
                                  f"(valid: 0..{len(node) - 1})")
            if last:
                node[int(part)] = value
            else:
                node = node[int(part)]
        elif isinstance(node, dict):
            if last:
                node[part] = value
            else:
                node = node.setdefault(part, {})
        else:
            raise ConfigError(f"--set {path}: '{'.'.join(parts[:depth])}' is a value, not a section")


# ---------------------------------------------------------------- paths
def _check_paths(cfg: RunConfig, base_dir: Path) -> list[str]:
    """Local files the run reads must exist (checked before any process group starts)."""
    errors = _source_count_problems(cfg.data.sources)
    errors += [line for i, src in enumerate(cfg.data.sources) for line in _source_problems(f"data.sources.{i}", src)]
    if cfg.model.bert_vocab and not (resolve_path(cfg.model.bert_vocab, base_dir) / "vocab.txt").is_file():
        errors.append(f"model.bert_vocab: {cfg.model.bert_vocab!r} holds no vocab.txt; fix: the folder of a "
                      "BERT vocabulary (one token a line), or remove the key to use the HuggingFace hub")
    for key, path in (("model.pretrained", cfg.model.pretrained), ("deepspeed.config", cfg.deepspeed.config)):
        kind = special_file(resolve_path(path, base_dir)) if path else None
        if kind:   # a FIFO would block its reader, /dev/zero be read without end
            errors.append(f"{key}: {path!r} is {kind}, not a regular file; fix: point it to the file itself")
    if cfg.model.pretrained and not resolve_path(cfg.model.pretrained, base_dir).exists():
        errors.append(f"model.pretrained: file {cfg.model.pretrained!r} does not exist")
    errors += _weights_header_problems(cfg, base_dir)
    if cfg.deepspeed.config and not resolve_path(cfg.deepspeed.config, base_dir).exists():
        errors.append(f"deepspeed.config: file {cfg.deepspeed.config!r} does not exist; fix: use one of "
                      "configs/deepspeed/zero{1,2,3}.json")
    for i, e in enumerate(cfg.eval.evals):
        if e.data and not resolve_path(e.data, base_dir).exists():
            errors.append(f"eval.evals.{i}.data: {e.data!r} does not exist; fix: build the evaluation set "
                          "first (crate-clip shards ...) or correct the path")
        else:
            errors += [f"eval.evals.{i}.{key}: {problem}" for key, problem in data_problems(e)]
    return errors


def _weights_header_problems(cfg: RunConfig, base_dir: Path) -> list[str]:
    """A weights file the run starts from holds what its header claims (checked against its size before any tower
    is built: crate_clip.checkpoint_io.weights_headers)."""
    problems = []
    model = cfg.model
    for key, value in (("model.pretrained", model.pretrained), ("model.text_pretrained", model.text_pretrained)):
        path = resolve_path(value, base_dir) if value else None
        if path is not None and path.is_file():   # a tag, a folder or a missing file: said elsewhere
            try:
                stored_values(path)
            except WeightsHeaderError as exc:
                problems.append(f"{key}: {exc}")
    return problems


COMPRESSIONS = set(COMPRESSED_MAGIC.values())
def path_problems(cfg: RunConfig, base_dir: Path) -> list[str]:
    """The files the run reads exist, and its output folder is one of its own; one line each."""
    return _check_paths(cfg, base_dir) + _output_dir_problems(cfg)


def _output_dir_problems(cfg: RunConfig) -> list[str]:
    """run.output_dir is a folder of the run's own: not `/` or a home folder, apart from the data (run_dir.py)."""
    return output_dir_problems(cfg.run.output_dir, cfg.data.sources, [e.data for e in cfg.eval.evals])


SHARDS_CHECKED = 16   # per source, spread over its list: a header read each, not a scan of every shard


def _source_count_problems(sources: list[str]) -> list[str]:
    """The brace patterns of data.sources together name at most MAX_SOURCE_SHARDS shards (each is counted, none
    expanded; one above the bound alone is its own line, from _source_problems)."""
    try:
        total = sum(pattern_count(source) or 0 for source in sources)
    except (TooManyShardsError, ShardListError):
        return []   # the source's own line says it
    try:
        check_shard_count(total, f"data.sources ({len(sources):,} sources together)")
    except TooManyShardsError as exc:
        return [str(exc)]
    return []


def _source_problems(key: str, source: str) -> list[str]:
    """A local source must name shards that exist and are tar files (a sample of them is opened); a brace pattern
    is counted before it is expanded."""
    refusal = refused_source(source)
    if refusal:
        return [f"{key}: {refusal}"]
    try:
        pattern_count(source)
    except (TooManyShardsError, ShardListError) as exc:   # above the bound, or unbalanced braces
        return [f"{key}: {exc}"]
    if is_remote(source):
        return []
    fix = "fix: write the shards first (crate-clip shards ...) or correct the path"
    try:
        shards = expand_source(source)
    except ShardListError:
        return [f"{key}: {source!r} names no .tar shard (an empty folder or a pattern that matches nothing); {fix}"]
    step = max(1, len(shards) // SHARDS_CHECKED)
    sample = shards[::step][:SHARDS_CHECKED]
    special = [(shard, kind) for shard in sample if (kind := special_file(shard, name_link=False))]
    if special:   # a FIFO would block the reader for ever, a device be read without end
        return [f"{key}: {special[0][0]!r} is {special[0][1]}, not a regular file; fix: give .tar files"]
    present = [shard for shard in sample if Path(shard).is_file()]
    if not present:   # a few missing shards of a pattern are counted by the stream, not an error
        return [f"{key}: {source!r} does not exist; {fix}"]
    compressed = [(shard, kind) for shard in present if (kind := tar_ending(shard)) in COMPRESSIONS]
    if compressed:
        return [f"{key}: {compressed[0][0]!r} is a {compressed[0][1]}-compressed tar, which the stream skips "
                "(it reads uncompressed .tar shards, member by member within bounds); fix: decompress the shards "
                "(e.g. gunzip, then rename to .tar)"]
    not_tar = [shard for shard in present if not tarfile.is_tarfile(shard)]
    if not_tar:
        return [f"{key}: {not_tar[0]!r} is not a tar file; fix: rewrite the shard (crate-clip shards ...) or "
                "remove it"]
    return []


def resolve_path(path: str, base_dir: Path) -> Path:
    """Relative paths in a config resolve against the working directory, else the config's folder."""
    p = Path(path).expanduser()
    if p.is_absolute() or p.exists() or not base_dir:
        return p
    candidate = base_dir / p
    return candidate if candidate.exists() else p


def _resolve_paths(cfg: RunConfig, base_dir: Path) -> None:
    """Make relative local paths found beside the config absolute, so every rank reads the same files."""
    # a refused URL (s3://) stays as written: its refusal names the pipe: form to use, which a path would mangle
    cfg.data.sources = [s if is_remote(s) or refused_source(s) else str(resolve_path(s, base_dir))
                        for s in cfg.data.sources]
    for e in cfg.eval.evals:
        e.data = str(resolve_path(e.data, base_dir)) if e.data else e.data
        if getattr(e, "classnames", None):
            e.classnames = str(resolve_path(e.classnames, base_dir))
    if cfg.deepspeed.config:
        cfg.deepspeed.config = str(resolve_path(cfg.deepspeed.config, base_dir))
    if cfg.model.pretrained:
        cfg.model.pretrained = str(resolve_path(cfg.model.pretrained, base_dir))
    if cfg.model.bert_vocab:
        cfg.model.bert_vocab = str(resolve_path(cfg.model.bert_vocab, base_dir))
    text = parse_weights_source(cfg.model.text_pretrained) if cfg.model.text_pretrained else None
    if text is not None and text.kind == LOCAL_DIR_KIND:
        cfg.model.text_pretrained = LOCAL_DIR + str(resolve_path(text.after_prefix, base_dir))
    elif text is not None and resolve_path(text.spec, base_dir).exists():
        cfg.model.text_pretrained = str(resolve_path(text.spec, base_dir))


def check_runtime(cfg: RunConfig, world_size: int, device: str = "cpu") -> None:
    """Checks that need the launch (world size, device); raises ConfigError naming the key."""
    errors = runtime_problems(cfg, world_size, device)
    if errors:
        raise ConfigError("invalid run config:\n  " + "\n  ".join(errors))


def runtime_problems(cfg: RunConfig, world_size: int, device: Optional[str] = "cpu") -> list[str]:
    """What check_runtime refuses, one line each (`device` None: not known yet, e.g. `--validate` on a login node)."""
    errors = [line for i, s in enumerate(cfg.stages)
              if (line := batch_problem(f"stages.{i}", s.global_batch, s.micro_batch, world_size))]
    if device == "cpu" and cfg.precision == "fp16":
        errors.append("precision: fp16 is not supported by DeepSpeed on CPU; fix: use bf16 or fp32")
    if "wandb" in cfg.logging.report_to and not _importable("wandb"):   # an optional extra
        errors.append("logging.report_to: names wandb, which is not installed; fix: pip install wandb "
                      "(or remove wandb from logging.report_to)")
    return errors


def _importable(module: str) -> bool:
    """Whether `module` imports (an optional extra installed)."""
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def batch_problem(key: str, global_batch: int, micro_batch, world_size: int) -> Optional[str]:
    """A stage's global batch must split into whole per-rank batches, and those into whole micro-batches."""
    if global_batch % world_size:
        return (f"{key}.global_batch: {global_batch} is not divisible by the {world_size} processes; fix: use a "
                f"multiple of {world_size}")
    if isinstance(micro_batch, int) and (global_batch // world_size) % micro_batch:
        return (f"{key}.micro_batch: {micro_batch} does not divide the per-rank batch {global_batch // world_size} "
                f"(global_batch {global_batch} / {world_size} processes); fix: a divisor of it, or \"auto\"")
    return None


# ---------------------------------------------------------------- entry points
def config_from_dict(raw: dict, *, base_dir: Path | None = None, check_paths: bool = True,
                     source_path: str | None = None) -> RunConfig:
    """Build and validate a RunConfig from a plain dict; raises ConfigError listing every bad key."""
    where = f" ({source_path})" if source_path else ""
    if not isinstance(raw, dict):
        raise ConfigError(f"run config{where}: expected a mapping at the top level, got {type(raw).__name__}")
    try:
        cfg = RunConfig.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(f"invalid run config{where}:\n  " + "\n  ".join(error_lines(err, RunConfig))) from None
    cfg._source_path = source_path
    _resolve_paths(cfg, base_dir or Path("."))
    errors = path_problems(cfg, base_dir or Path(".")) if check_paths else []
    if errors:
        raise ConfigError(f"invalid run config{where}:\n  " + "\n  ".join(errors))
    return cfg


def load_run_config(path: str | Path, overrides: list[str] | tuple = (), *, check_paths: bool = True) -> RunConfig:
    """Load a YAML run config, apply `--set` overrides, validate; raises ConfigError naming the key."""
    path = Path(path)
    raw = load_yaml_file(path) or {}   # a regular file, every YAML problem and alias bomb one line
    raw = copy.deepcopy(raw)
    for assignment in overrides:
        apply_override(raw, assignment)
    return config_from_dict(raw, base_dir=path.parent, check_paths=check_paths, source_path=str(path))
