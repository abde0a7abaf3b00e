"""How a model runs at an image size other than its own (`crate-clip eval --resize`, the stage evaluations):
'grid' grows (or shrinks) the patch grid at the same patch size, the position embedding resampled; 'patch' keeps
the grid and PI-resizes the patch kernel (FlexiViT), so each token still covers the same share of the image it
covered in training. Here, not in crate_clip.models.patch_change (which does the resizing), so that the CLI's
--help names the modes without importing torch."""

RESOLUTION_RESIZE_MODES = ("grid", "patch")
