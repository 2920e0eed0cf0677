"""Checkpoint weights: lazy readers for safetensors / PyTorch checkpoints and a safetensors writer."""

from .io import (
    SAFETENSORS_DTYPES,
    MissingTensorError,
    TensorStore,
    merge_stores,
    open_checkpoint,
    open_sharded,
    save_safetensors,
)

__all__ = [
    "SAFETENSORS_DTYPES",
    "MissingTensorError",
    "TensorStore",
    "merge_stores",
    "open_checkpoint",
    "open_sharded",
    "save_safetensors",
]
