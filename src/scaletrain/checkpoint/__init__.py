"""Checkpoint storage. For now: atomic writes, used for every file a run leaves behind."""

from scaletrain.checkpoint.atomic import atomic_path, write_text_atomic

__all__ = ["atomic_path", "write_text_atomic"]
