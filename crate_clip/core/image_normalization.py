"""The per-channel (R, G, B) image mean and std the models are trained and evaluated with: the one place
every package takes them from (towers, open_clip configs, the training stream, the evaluations).

Plain numbers, no open_clip import: this bottom-layer module is imported while crate_clip.models registers
itself (after open_clip's import), so importing open_clip here would re-enter that half-done import. They
equal open_clip.constants' (tests/test_doc_snippets.py checks it)."""

# OpenAI CLIP's data set statistics: open_clip's default, and ours for every model but the CLIPA ones
OPENAI_MEAN: tuple[float, float, float] = (0.48145466, 0.4578275, 0.40821073)
OPENAI_STD: tuple[float, float, float] = (0.26862954, 0.26130258, 0.27577711)
# ImageNet's (timm's defaults): the CRATE-alpha-CLIPA models' training and evaluation, and the timm classifiers
IMAGENET_MEAN: tuple[float, float, float] = (0.485, 0.456, 0.406)
IMAGENET_STD: tuple[float, float, float] = (0.229, 0.224, 0.225)
