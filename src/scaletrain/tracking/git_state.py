"""The state of the working directory's git repository, for run tags and the run card.

The uncommitted diff itself is never kept: a key pasted into a tracked file would ship with
the run card to the tracking server. Its sha256 (which ``reproduce`` compares) and the names
of the changed files are. git runs without the repository's external diff, textconv and
fsmonitor programs: recording a run in an untrusted checkout runs none of its commands.
"""

from __future__ import annotations

import hashlib
import subprocess
from typing import Any

__all__ = ["git_state"]

_FILES_LIMIT = 200  # changed file names kept
_SAFE = ("-c", "core.fsmonitor=false")
_SAFE_DIFF = ("diff", "--no-ext-diff", "--no-textconv", "--no-color")


def _git(*args: str) -> str | None:
    try:
        return subprocess.run(  # noqa: S603  fixed git arguments, never a shell
            ["git", *_SAFE, *args],  # noqa: S607  the user's git on PATH, as they run it
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def git_state() -> dict[str, Any] | None:
    """Commit, branch, dirty flag, the sha256 of the tracked changes and the changed files'
    names; None outside a repository."""
    commit = _git("rev-parse", "HEAD")
    if not commit:
        return None
    diff = _git(*_SAFE_DIFF, "HEAD") or ""
    files = [f for f in (_git(*_SAFE_DIFF, "--name-only", "-z", "HEAD") or "").split("\0") if f]
    return {
        "commit": commit.strip(),
        "branch": (_git("rev-parse", "--abbrev-ref", "HEAD") or "").strip(),
        "dirty": bool(diff),
        "diff_sha256": hashlib.sha256(diff.encode()).hexdigest() if diff else None,
        "changed_files": files[:_FILES_LIMIT],
    }
