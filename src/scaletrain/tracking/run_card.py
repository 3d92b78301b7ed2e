"""The run card: what it takes to run this job again and get the same bits.

Software (Python, every installed package, torch/CUDA/cuDNN/NCCL), hardware (CPU, GPUs,
OS), code (git commit, branch, the sha256 of uncommitted changes and the files they touch,
never the diff itself: it can hold a pasted key), the seed and determinism
settings, and a fingerprint of the training data. Rank 0 writes it as ``run_card.json``;
the launcher logs it to MLflow. ``scaletrain reproduce`` compares two of them.
"""

from __future__ import annotations

import hashlib
import os
import platform
import re
import socket
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from scaletrain.rundir import RUN_CARD_FILE
from scaletrain.rundir.atomic import write_text_atomic
from scaletrain.tracking.redact import Redactor

__all__ = ["build_run_card", "write_run_card", "data_fingerprint", "compare_run_cards"]



def data_fingerprint(task: Any, dataset: Any, samples: int = 256) -> str:
    """The task's own ``data_fingerprint()`` if it has one, else a sha256 over the length and
    an evenly spread sample of items (cheap for big datasets, sensitive to changed data)."""
    if callable(getattr(task, "data_fingerprint", None)):
        return str(task.data_fingerprint())
    if callable(getattr(dataset, "fingerprint", None)):  # ParquetShards: its layout and first row group
        return str(dataset.fingerprint())
    if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        # A stream is read once, in order, by training: reading it here too would cost a pass's start.
        return (f"not known: a stream ({type(dataset).__name__}); give the task a data_fingerprint() "
                "method to record one")
    digest = hashlib.sha256()
    n = len(dataset)
    digest.update(str(n).encode())
    for index in sorted({i * n // samples for i in range(min(n, samples))}):
        try:
            item = dataset[index]
        except Exception as exc:  # a corrupt sample (data.on_error: skip) is part of the data too
            digest.update(f"raised {type(exc).__name__}".encode())
            continue
        _hash_item(digest, item)
    return "sha256:" + digest.hexdigest()


def _hash_item(digest: Any, item: Any) -> None:
    if isinstance(item, torch.Tensor):
        tensor = item.detach().cpu().contiguous()
        digest.update(str(tensor.dtype).encode() + str(tuple(tensor.shape)).encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(item, (tuple, list)):
        for part in item:
            _hash_item(digest, part)
    elif isinstance(item, dict):
        for key in sorted(item):
            digest.update(str(key).encode())
            _hash_item(digest, item[key])
    else:
        digest.update(repr(item).encode())


def build_run_card(job: dict[str, Any], fingerprint: str, world_size: int,
                   git: dict[str, Any] | None) -> dict[str, Any]:
    """The environment of a run. Nothing here starts a process (rank 0 builds it in a thread
    while its DataLoader may be forking workers): ``git`` comes from the launcher."""
    cuda = torch.cuda.is_available()
    return {
        "python": sys.version.split()[0],
        "packages": installed_packages(),
        "torch": {
            "version": torch.__version__,
            "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version() if cuda else None,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
        },
        "hardware": {
            "host": socket.gethostname(),
            "cpu": _cpu_model(),
            "cpu_count": os.cpu_count(),
            "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
            "world_size": world_size,
        },
        "os": os_name(),
        "git": git,
        "seed": job.get("seed"),
        "deterministic": job.get("deterministic"),
        "data_fingerprint": fingerprint,
    }


def os_name() -> str:
    """``platform.platform()``'s string ("Linux-6.1.0-x86_64-with-glibc2.36") without its
    ``uname -p`` subprocess (which it runs to learn the processor, then leaves out)."""
    system, release, machine = platform.system(), platform.release(), platform.machine()
    if system == "Linux":
        lib, version = platform.libc_ver()
        if lib:
            return "-".join(part.replace(" ", "_") for part in (system, release, machine, "with", lib + version))
    return platform.platform()


def installed_packages() -> list[str]:
    """``name==version`` of every installed distribution (names in PEP 503's canonical form),
    read from the names of the ``*.dist-info``/``*.egg-info`` folders on sys.path, the first
    of a name winning as it does for imports: what pip freeze lists, without parsing ~300
    METADATA files (importlib.metadata's way: 0.7 s of rank 0's interpreter while it trains)."""
    found: dict[str, str] = {}
    for entry in sys.path:
        try:
            names = sorted(item.name for item in os.scandir(entry or "."))
        except OSError:
            continue
        for folder in names:
            stem, dot, kind = folder.rpartition(".")
            if not dot or kind not in ("dist-info", "egg-info"):
                continue
            name, _, version = stem.partition("-")
            version = version.split("-", 1)[0]  # an egg's -py3.11 suffix
            if name and version:
                found.setdefault(canonical_name(name), version)
    if not found:  # a layout without metadata folders (a zip, an exotic finder): ask importlib
        found = {canonical_name(d.metadata["Name"]): d.version for d in metadata.distributions() if d.metadata["Name"]}
    return [f"{name}=={version}" for name, version in sorted(found.items())]


def canonical_name(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def write_run_card(run_dir: str | Path, card: dict[str, Any], redactor: Redactor) -> Path:
    path = Path(run_dir) / RUN_CARD_FILE
    write_text_atomic(path, redactor.json(card, indent=2))
    return path


def compare_run_cards(recorded: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Human lines for every difference that can change results: code, packages, hardware."""
    lines = []
    old_git, new_git = recorded.get("git") or {}, current.get("git") or {}
    if old_git.get("commit") != new_git.get("commit"):
        lines.append(f"git commit: {old_git.get('commit')} -> {new_git.get('commit')}")
    if old_git.get("diff_sha256") != new_git.get("diff_sha256"):
        lines.append("uncommitted changes differ")
    old_pkgs = _by_name(recorded.get("packages", []))
    new_pkgs = _by_name(current.get("packages", []))
    for name in sorted(set(old_pkgs) | set(new_pkgs), key=str.lower):
        if old_pkgs.get(name) != new_pkgs.get(name):
            lines.append(f"package {name}: {old_pkgs.get(name, 'absent')} -> {new_pkgs.get(name, 'absent')}")
    for key in ("python", "os", "data_fingerprint"):
        if recorded.get(key) != current.get(key):
            lines.append(f"{key}: {recorded.get(key)} -> {current.get(key)}")
    for key in ("cpu", "cpu_count", "gpus", "world_size"):
        old, new = (recorded.get("hardware") or {}).get(key), (current.get("hardware") or {}).get(key)
        if old != new:
            lines.append(f"hardware {key}: {old} -> {new}")
    return lines


def _by_name(packages: list[str]) -> dict[str, str]:
    """``name==version`` lines by canonical name (run cards before 0.x kept METADATA's spelling)."""
    pairs = (line.split("==", 1) for line in packages if "==" in line)
    return {canonical_name(name): version for name, version in pairs}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
