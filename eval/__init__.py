"""Zero-shot classification and retrieval evaluation for CLIP models (open_clip-compatible numbers)."""
