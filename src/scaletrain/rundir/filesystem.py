"""Where files live when a path is a URL (``s3://``, ``gs://``...): fsspec's filesystem for it,
with one line naming the extra or driver to install when it cannot be opened. Checkpoint storage
and Parquet shards both open their locations here."""

from __future__ import annotations

from typing import Any

from scaletrain.errors import ScaletrainError

__all__ = ["open_filesystem"]


def open_filesystem(url: str, error: type[ScaletrainError], subject: str) -> tuple[Any, str]:
    """(filesystem, path) for ``url``; ``subject`` names what asked (``checkpoint.dir 's3://..'``)
    in the ``error`` raised when fsspec or the protocol's driver is missing."""
    try:
        import fsspec
    except ImportError:
        raise error(f"{subject} needs fsspec; install it with: pip install 'scaletrain[s3]'") from None
    try:
        # A fresh client: fsspec's instance cache keys on arguments, not on the environment
        # (AWS_ENDPOINT_URL, credentials) a client was made with, which may have changed.
        return fsspec.core.url_to_fs(url, skip_instance_cache=True)
    except (ImportError, ValueError) as exc:
        protocol = url.split("://", 1)[0]
        hint = "pip install 'scaletrain[s3]'" if protocol in ("s3", "s3a") else f"the fsspec driver for {protocol}://"
        raise error(f"{subject}: {exc}; install {hint}") from None
