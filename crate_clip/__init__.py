"""crate-clip: CLIPA-style contrastive pretraining with a CRATE-alpha image tower.

Importing this package registers the CRATE / CRATE-alpha towers with timm and the CRATE-alpha CLIP
model configs with open_clip, so `timm.create_model('crate_alpha_base_patch16_224')` and
`open_clip.create_model_and_transforms('CRATE-alpha-CLIPA-L-14')` work afterwards.
"""
from crate_clip import models  # noqa: F401  (registers timm models and open_clip configs)

__version__ = "0.1.0"
