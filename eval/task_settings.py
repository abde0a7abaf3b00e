"""The settings schema of every evaluation task (a run config's `eval.evals` entries and the options of
`crate-clip eval TASK`), apart from the tasks' code in eval/tasks/: pydantic only, so the CLI's --help and a
config's validation import no torch or open_clip. Each task `NAME` has its class here, registered in
TASK_SETTINGS, and its module eval/tasks/NAME.py (run, summary, ...); crate_clip.eval.registry joins them."""
from __future__ import annotations

from typing import ClassVar, Literal, Optional

from pydantic import Field

from crate_clip.core.config_schema import Float, Int
from crate_clip.eval.eval_settings import EvalSettings

# the names of the built-in class sets and template sets (their contents: crate_clip.eval.class_sets)
BUILTIN_DATASETS = ("imagenet1k", "fashion_mnist")
TEMPLATE_SETS = ("openai", "simple", "fashion_mnist", "plain")
DEFAULT_TEMPLATES = {"imagenet1k": "openai", "fashion_mnist": "fashion_mnist"}
DEFAULT_DATASET = "imagenet1k"   # the data set when neither a name nor the data's own classnames.txt says
CLASSNAMES_FILE = "classnames.txt"
TEMPLATES_FILE = "zeroshot_classification_templates.txt"   # CLIP_benchmark's name; `{c}` for the class
TIMM_PREFIX = "timm:"   # `crate-clip eval --model timm:NAME`: a timm classifier's tower features (linear probe)


class ZeroshotSettings(EvalSettings):
    """Zero-shot classification: text classifier from class names x templates, then top-1/top-5 accuracy."""

    has_details: ClassVar[bool] = True   # `--details`: the per-class table
    has_per_image: ClassVar[bool] = True   # `--per-image-out FILE`: each image's top-1 class (paired comparisons)
    type: Literal["zeroshot"] = Field("zeroshot", description="the task (an entry without a type is a zeroshot one)")
    dataset: Optional[str] = Field(None, description=f"{' | '.join(BUILTIN_DATASETS)} (built-in class names) | any "
                                   f"name with classnames or {CLASSNAMES_FILE} beside the data (default: the data's "
                                   f"own {CLASSNAMES_FILE}, else {DEFAULT_DATASET}; a built-in set that disagrees "
                                   "with the data's own is refused)")
    templates: Optional[str] = Field(None, description=f"{' | '.join(TEMPLATE_SETS)} | a file of '{{}}' "
                                                       f"or '{{c}}' lines (default: {TEMPLATES_FILE} beside the "
                                                       f"data, else the dataset's, {DEFAULT_TEMPLATES})")
    classnames: Optional[str] = Field(None, description="file with one class name per line, in label order")
    labels: Optional[str] = Field(None, description="ground truth for a flat val folder (`file label` lines, "
                                                    "one label per line, or Kaggle's LOC_val_solution.csv)")


class RetrievalSettings(EvalSettings):
    """Image<->text retrieval on captioned shards (`.jpg` + `.txt`): recall@1/5/10, mean and median rank."""

    has_details: ClassVar[bool] = False
    type: Literal["retrieval"] = Field("retrieval", description="the task")


class LinearProbeSettings(EvalSettings):
    """Linear probe and few-shot evaluation (the CLIP_benchmark protocol) on cached image features.

    The keys of a `type: linear_probe` eval entry and the options of `crate-clip eval linear-probe`. The test
    split is `data`; `batch_size` is the feature-extraction batch."""

    has_details: ClassVar[bool] = False
    type: Literal["linear_probe"] = Field("linear_probe", description="the task")
    train_data: str = Field("", description="training split: ImageFolder, flat folder (with train_labels) or .cls shards")
    dataset: str = Field("custom", description="fashion_mnist / imagenet1k (built-in class lists) or any name")
    classnames: Optional[str] = Field(None, description="class-name file: the classes that folders are matched to; "
                                                        "default classnames.txt beside the data")
    train_labels: Optional[str] = Field(None, description="label file of a flat training folder")
    labels: Optional[str] = Field(None, description="label file of a flat test folder")
    features: Literal["auto", "image", "tower"] = Field("auto", description="image: CLIP image embedding; tower: "
                                                        "pooled pre-projection features (auto: image for CLIP, "
                                                        "tower for a timm:NAME classifier)")
    normalize: bool = Field(True, description="L2-normalise the features")
    max_train_images: Optional[Int] = Field(None, ge=1, description="use this many training images (spread evenly)")
    fewshot_k: Optional[Int] = Field(None, ge=1, description="k training images per class (few-shot probe)")
    fewshot_seeds: Int = Field(3, ge=1, description="few-shot draws (seeds 0..n-1): mean and spread")
    weight_decay: Optional[Float] = Field(None, ge=0, description="fixed weight decay (skips the validation search)")
    epochs: Int = Field(10, ge=1, description="probe training epochs")
    lr: Float = Field(0.1, gt=0, description="AdamW learning rate of the probe (cosine schedule, no warm-up)")
    probe_batch_size: Int = Field(64, ge=1, description="batch size of the probe's training")
    val_proportion: Float = Field(0.2, gt=0, lt=1, description="share of the training split held out to choose "
                                                                "the weight decay")
    seed: Int = Field(0, description="seed of the held-out split and of the probe's initialisation and order")

    def checks(self) -> list[tuple[str, str]]:
        """The training split is required."""
        problems = super().checks()
        if not str(self.train_data).strip():
            problems.append(("train_data", "empty; fix: the labelled training split of the linear probe"))
        return problems


# task name (the `type` key, the module eval/tasks/NAME.py) -> its settings
TASK_SETTINGS = {cls.model_fields["type"].default: cls
                 for cls in (LinearProbeSettings, RetrievalSettings, ZeroshotSettings)}   # by name, as the docs list them


def task_help(name: str) -> str:
    """The task's one-line description (its settings' docstring's first line)."""
    return (TASK_SETTINGS[name].__doc__ or name).splitlines()[0]
