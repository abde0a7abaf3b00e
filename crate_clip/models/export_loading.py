"""The one way to open an export (an open_clip model folder): the checksums its config records verified, the
image tower it names registered, the model created by open_clip without the random-init log. crate_clip.export's
`load_export` and crate_clip.eval's `local-dir:` loading both go through `create_from_export`."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from crate_clip.checkpoint_io.bounded_reads import read_small_json
from crate_clip.checkpoint_io.file_checksums import verify_recorded_checksums
from crate_clip.models.clip_weights import quiet_random_init
from crate_clip.models.export_files import CONFIG_FILE, LOCAL_DIR
from crate_clip.models.export_folder_check import (check_model_fits_weights, check_tower_fits_weights,
                                                  export_weights_file, note_links_leaving)
from crate_clip.models.model_cfg_check import check_model_cfg, check_preprocess_cfg
from crate_clip.models.patch_change import register_tower_of


def create_from_export(folder: Path | str, create: Callable, **kwargs):
    """`create('local-dir:<folder>', **kwargs)` (an open_clip factory) once the export is checked: its config and
    weights are regular files (links out of the folder named on stderr), its files match the checksums its config
    records (when it records them; a mismatch is an error naming the file), its config and preprocessing are bounded
    and finite (docs/safety.md), its weights file's header is held to the file's size, neither an image tower of
    another timm architecture nor the whole model has more parameters than the weights hold values, and its tower,
    which an export may name in the underscore form, is registered with timm."""
    folder = Path(folder)
    config_path = folder / CONFIG_FILE
    weights = export_weights_file(folder)   # the file open_clip will load: a regular file, not a FIFO or device
    note_links_leaving(folder, (config_path, weights))
    if os.path.lexists(config_path):
        config = read_small_json(config_path)   # a regular file of bounded size
        verify_recorded_checksums(folder, config, config_path)
        # the sizes it names are checked before anything is allocated
        model_cfg = config.get("model_cfg") if isinstance(config, dict) else config
        check_model_cfg(model_cfg, config_path)
        check_preprocess_cfg(config.get("preprocess_cfg"), config_path)
        register_tower_of(model_cfg)
        check_tower_fits_weights(model_cfg, weights, config_path)   # another timm architecture: by its weights
        check_model_fits_weights(folder, weights, config_path)      # any model: its parameters by its weights
    with quiet_random_init():   # open_clip logs it for local-dir: models although their weights are loaded
        return create(f"{LOCAL_DIR}{folder}", **kwargs)
