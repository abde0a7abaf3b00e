"""The registration: the CRATE / CRATE-alpha image towers with timm (as crate_alpha.py loads), the CRATE-alpha text
tower's builder with open_clip (a text_cfg with "tower": "crate_alpha") and the CRATE-alpha CLIP configs with
open_clip. Imported by crate_clip's post-import hook once timm or open_clip is imported, and before the first name
taken from crate_clip.models."""
import importlib

from crate_clip.models.open_clip_configs import register_open_clip_configs
from crate_clip.models.open_clip_text_tower import install_text_tower_builder

# the modules whose import registers something: crate_alpha.py its timm entry points (clip_tower_names.py, which
# open_clip_configs.py imports, the parametric family), crate_text.py its text tower kind
for _module in ("crate_alpha", "crate_text"):
    importlib.import_module(f"crate_clip.models.{_module}")
install_text_tower_builder()
CLIP_MODEL_NAMES = register_open_clip_configs()
