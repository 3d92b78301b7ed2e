"""Verified checkpoints: DCP for the state, a manifest of hashes written last, atomic storage
(local or object storage), retention."""

from scaletrain.checkpoint.atomic import atomic_path, write_text_atomic

__all__ = ["atomic_path", "write_text_atomic"]
