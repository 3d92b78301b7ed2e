"""A TensorFlow job's checkpoint: TF's own (``tf.train.Checkpoint``: the model, the optimizer
with its step, and the layers' random-number state, so dropout after a resume draws what it
would have), written into the CheckpointManager's staging folder as ``tf.index`` and
``tf.data-*``: the same hashes, manifest, atomic commit, verification, retention and storage
as a PyTorch job's. The step and the data position go to trainer.json beside it.

Every worker writes (reading a variable synchronized on read is a collective under
tf.distribute); only rank 0's copy is kept. TF's tensor bundle is data, not code: a load reads
tensors into the live variables, after the manifest's hashes checked every byte."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

from scaletrain.checkpoint.manifest import (
    TF_INDEX_FILE,
    CheckpointRefused,
    FileEntry,
    Manifest,
    ManifestError,
    file_path,
    hash_files,
)
from scaletrain.checkpoint.state import Written
from scaletrain.errors import ScaletrainError

__all__ = ["KerasState"]

_PREFIX = TF_INDEX_FILE.removesuffix(".index")


class KerasState:
    supports_async = False

    def __init__(self, model: Any, optimizer: Any, rank: int):
        import tensorflow as tf

        weights = {id(v) for v in model.weights}
        # model.variables beyond its weights: the seed generators' states (dropout, noise layers)
        random_state = [v for v in model.variables if id(v) not in weights]
        self.checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer, random=random_state)
        self.rank = rank

    def write(self, staging: Path, group: Any) -> Written:
        if self.rank == 0:
            self.checkpoint.write(str(staging / _PREFIX))
            return {}  # hashed from disk by the manager
        scratch = tempfile.mkdtemp(prefix="scaletrain-tf-ckpt-")
        try:
            self.checkpoint.write(str(Path(scratch) / _PREFIX))
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        return {}

    def own_files(self, staging: Path, rank: int) -> list[str]:
        if rank != 0:
            return []
        return sorted(p.name for p in staging.iterdir() if p.name.startswith(f"{_PREFIX}."))

    def check_index(self, local: Path, manifest: Manifest) -> None:
        """TF's index lists the data shards it needs: each must be in the manifest."""
        if TF_INDEX_FILE not in manifest.files:
            raise ManifestError(f"it holds no TensorFlow checkpoint ({TF_INDEX_FILE}); it was written by a "
                                "PyTorch job")
        import tensorflow as tf

        try:
            tf.train.load_checkpoint(str(local / _PREFIX))
        except Exception as exc:  # TF's reader: a damaged index or a missing shard
            raise ManifestError(f"TF cannot read its index: {type(exc).__name__}") from None

    def read(self, local: Path, files: dict[str, FileEntry], group: Any) -> None:
        if self.rank != 0:  # rank 0 verified these bytes; the others check what they read now
            for name, entry in hash_files(local, sorted(files)).items():
                if entry != files[name]:
                    raise CheckpointRefused(f"{name} changed since it was verified")
        index = file_path(local, TF_INDEX_FILE)  # refused if it leads out of the folder
        status = self.checkpoint.read(str(index.with_suffix("")))
        try:
            status.assert_existing_objects_matched()
        except AssertionError as exc:
            raise ScaletrainError(f"the checkpoint does not fit this model: {str(exc).splitlines()[0]}; "
                                  "resume with the job (and task.args) that wrote it") from None
