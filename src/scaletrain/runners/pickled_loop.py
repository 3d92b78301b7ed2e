"""A loop defined in ``__main__`` (a notebook cell, a script) reaches fresh worker processes by
value: ``scaletrain.run_loop`` pickles it with cloudpickle (as Ray does) into a private file, and
the workers load it only if its HMAC verifies with a key that never touches disk (it travels
in the workers' environment). A file that does not verify is refused unread: nothing but the
launching process's own function is ever unpickled.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import pickle  # noqa: S403  only a payload whose HMAC verifies (see the module's docstring)
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any

from scaletrain.errors import ScaletrainError
from scaletrain.rundir.names import LOOP_FILE_ENV, LOOP_KEY_ENV

__all__ = ["write_loop", "read_loop", "MAIN_MODULE"]

MAIN_MODULE = "__main__"
_DIGEST_LEN = 64  # hex sha256


def write_loop(function: Callable[..., Any], folder: Path) -> dict[str, str]:
    """Pickle ``function`` into ``folder`` (owner-only); returns the environment its workers need."""
    import cloudpickle

    payload = cloudpickle.dumps(function)
    key = secrets.token_hex(32)
    path = Path(folder) / "loop.pkl"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(_digest(key, payload).encode() + b"\n" + payload)
    return {LOOP_FILE_ENV: str(path), LOOP_KEY_ENV: key}


def read_loop(name: str) -> Callable[..., Any]:
    """The function ``scaletrain.run_loop`` handed over, verified, or one line saying why not."""
    path, key = os.environ.get(LOOP_FILE_ENV), os.environ.get(LOOP_KEY_ENV)
    if not path or not key:
        raise ScaletrainError(
            f"loop.target '{MAIN_MODULE}:{name}' names a function of the script or notebook that "
            "started the job: it runs only through scaletrain.run_loop(...) from there; to run it from "
            "a job file or `scaletrain resume`, move it into a module and name that"
        )
    try:
        blob = Path(path).read_bytes()
    except OSError as exc:
        raise ScaletrainError(f"the loop handed over by scaletrain.run_loop cannot be read on this "
                              f"machine ({exc.strerror}: {path}); on a cluster, put the loop in a "
                              "module the workers can import") from None
    digest, _, payload = blob.partition(b"\n")
    if not hmac.compare_digest(digest.decode("ascii", "replace"), _digest(key, payload)):
        raise ScaletrainError(f"refused the loop in {path}: its HMAC does not verify (the file was "
                              "changed after scaletrain.run_loop wrote it)")
    function = pickle.loads(payload)  # noqa: S301  verified above: this process's launcher wrote it
    if not callable(function):
        raise ScaletrainError(f"the loop handed over by scaletrain.run_loop is not a function: {type(function).__name__}")
    return function


def _digest(key: str, payload: bytes) -> str:
    return hmac.new(key.encode(), payload, hashlib.sha256).hexdigest()
