"""Linear probe / few-shot classification on cached image features (CLIP_benchmark protocol, eval/linear_probe.py)."""
from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field

from crate_clip.config_schema import Float, Int
from eval import linear_probe
from eval.eval_settings import EvalSettings


class Settings(EvalSettings):
    """Linear-probe settings: the labelled training split besides the test split (`data`)."""

    type: Literal["linear_probe"] = "linear_probe"
    train_data: str = Field("", description="training split: ImageFolder, flat folder (with train_labels) or .cls shards")
    dataset: str = Field("custom", description="fashion_mnist / imagenet1k (built-in class lists) or any name")
    classnames: Optional[str] = Field(None, description="class-name file; default classnames.txt beside the data")
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

    def checks(self) -> list[tuple[str, str]]:
        """The training split is required."""
        problems = super().checks()
        if not str(self.train_data).strip():
            problems.append(("train_data", "empty; fix: the labelled training split of the linear probe"))
        return problems


def run(model, settings: Settings, context) -> dict:
    """Linear-probe metrics of `model` (a CLIP or a timm classifier; all ranks call this)."""
    keys = set(linear_probe.Settings.model_fields) & set(Settings.model_fields) - {"fewshot_seeds"}
    probe = linear_probe.Settings(**{k: getattr(settings, k) for k in keys},
                                  fewshot_seeds=list(range(settings.fewshot_seeds)))
    return linear_probe.run(model, preprocess=context.preprocess, settings=probe, device=context.device,
                            precision=context.precision, cache_dir=context.cache_dir, progress=context.progress)


def summary(metrics: dict) -> str:
    """One line for the console."""
    return linear_probe.summary(metrics)
