"""The state of the working directory's git repository, for run tags and the run card."""

from __future__ import annotations

import hashlib
import subprocess
from typing import Any

__all__ = ["git_state"]

_DIFF_LIMIT = 200_000  # characters of uncommitted diff kept


def _git(*args: str) -> str | None:
    try:
        return subprocess.run(
            ["git", *args], capture_output=True, text=True, timeout=10, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def git_state() -> dict[str, Any] | None:
    """Commit, branch, dirty flag and the diff of tracked changes; None outside a repository."""
    commit = _git("rev-parse", "HEAD")
    if not commit:
        return None
    diff = _git("diff", "HEAD") or ""
    return {
        "commit": commit.strip(),
        "branch": (_git("rev-parse", "--abbrev-ref", "HEAD") or "").strip(),
        "dirty": bool(diff),
        "diff_sha256": hashlib.sha256(diff.encode()).hexdigest() if diff else None,
        "diff": diff[:_DIFF_LIMIT],
        "diff_truncated": len(diff) > _DIFF_LIMIT,
    }
