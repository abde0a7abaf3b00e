"""DataComp-layout webdataset shards: the training stream (reading) and shard writing from local sources.

Main entry points (imported lazily so `import crate_clip.data` stays cheap):
`StreamConfig`, `build_train_stream`, `TrainStream` (train_stream), `merge_stream_states`,
`split_stream_state` (stream_layout: a checkpoint's stream states at another world size), `write_shards` (shard_writer),
`write_fashion_mnist_shards`, `write_fashion_mnist_eval_folder`,
`write_fashion_mnist_classification_shards` (sources.fashion_mnist), `write_classification_shards`,
`write_image_folder` (eval_sets).
"""
import importlib

_EXPORTS = {
    "StreamConfig": "train_stream", "build_train_stream": "train_stream", "TrainStream": "train_stream",
    "merge_stream_states": "stream_layout", "split_stream_state": "stream_layout",
    "write_shards": "shard_writer",
    "write_fashion_mnist_shards": "sources.fashion_mnist",
    "write_fashion_mnist_eval_folder": "sources.fashion_mnist",
    "write_fashion_mnist_classification_shards": "sources.fashion_mnist",
    "write_classification_shards": "eval_sets", "write_image_folder": "eval_sets",
    "TextReducer": "text_reduction", "select_pos_tagger": "pos_tagging",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    """Import the module that defines an exported name on first use."""
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
