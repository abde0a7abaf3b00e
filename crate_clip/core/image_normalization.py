"""The per-channel (R, G, B) image mean and std the models are trained and evaluated with: the one place
every package takes them from (towers, open_clip configs, the training stream, the evaluations)."""
from open_clip.constants import IMAGENET_MEAN, IMAGENET_STD, OPENAI_DATASET_MEAN, OPENAI_DATASET_STD

# OpenAI CLIP's data set statistics: open_clip's default, and ours for every model but the CLIPA ones
OPENAI_MEAN: tuple[float, float, float] = tuple(OPENAI_DATASET_MEAN)
OPENAI_STD: tuple[float, float, float] = tuple(OPENAI_DATASET_STD)
# ImageNet's (timm's defaults): the CRATE-alpha-CLIPA models' training and evaluation, and the timm classifiers
IMAGENET_MEAN: tuple[float, float, float] = tuple(IMAGENET_MEAN)
IMAGENET_STD: tuple[float, float, float] = tuple(IMAGENET_STD)
