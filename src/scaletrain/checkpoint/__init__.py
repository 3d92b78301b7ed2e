"""Verified checkpoints: DCP for the state, a manifest of hashes written last, atomic storage
(local or object storage), retention."""
