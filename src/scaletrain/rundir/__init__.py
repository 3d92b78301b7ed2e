"""The run directory, at the bottom of the package: every name in it (names.py), atomic writes
(atomic.py), the spec a launcher hands its workers (spec.py), the launcher's lock (lock.py), and
fsspec's filesystem for a location that is a URL (filesystem.py).
Launchers, workers, the tracking process and the checkpoint tools all read it; it imports
nothing of scaletrain but its errors."""

from scaletrain.rundir.atomic import atomic_path, fsync_dir, write_text_atomic
from scaletrain.rundir.lock import RunInUse, RunLock
from scaletrain.rundir.names import *  # noqa: F403  re-exported: names.py's __all__, listed below
from scaletrain.rundir.names import __all__ as _names
from scaletrain.rundir.spec import RunSpec, check_run_ref, new_run_id

__all__ = ["RunSpec", "new_run_id", "check_run_ref", "RunLock", "RunInUse", "atomic_path", "fsync_dir",
           "write_text_atomic", *_names]
