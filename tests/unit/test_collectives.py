"""Every collective scaletrain issues goes through distributed/collectives.py, and that helper
puts a tensor where its group's backend takes it (NCCL takes only CUDA tensors)."""

import ast
from pathlib import Path

import pytest
import torch

import scaletrain
from scaletrain.distributed import collectives
from scaletrain.engine.weights import state_dict_sha256
from tests.helpers.tasks import toy_job

SRC = Path(scaletrain.__file__).resolve().parent
HELPER = SRC / "distributed" / "collectives.py"
# torch.distributed calls that move data between ranks (c10d's public collectives).
COLLECTIVES = {
    "all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_object", "all_gather_into_tensor",
    "all_to_all", "all_to_all_single", "broadcast", "broadcast_object_list", "reduce", "reduce_scatter",
    "reduce_scatter_tensor", "gather", "gather_object", "scatter", "scatter_object_list", "barrier",
    "monitored_barrier", "send", "recv", "isend", "irecv", "batch_isend_irecv",
}


def raw_collectives(source: str) -> list[str]:
    """``dist.X(...)``, ``torch.distributed.X(...)``, names imported from torch.distributed and
    DTensor ``.full_tensor()`` calls in ``source``: collectives that bypass the helper."""
    tree = ast.parse(source)
    imported = set()
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "torch.distributed":
            for alias in node.names:
                if alias.name in COLLECTIVES:
                    imported.add(alias.asname or alias.name)
                    found.append(f"line {node.lineno}: from torch.distributed import {alias.name}")
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Attribute):
            owner = ast.unparse(func.value)
            if func.attr in COLLECTIVES and owner in ("dist", "torch.distributed", "c10d"):
                found.append(f"line {node.lineno}: {owner}.{func.attr}")
            elif func.attr == "full_tensor" and owner != "collectives":
                found.append(f"line {node.lineno}: .full_tensor()")
        elif isinstance(func, ast.Name) and func.id in imported:
            found.append(f"line {node.lineno}: {func.id}")
    return found


def test_the_walker_finds_each_kind_of_raw_collective():
    source = (
        "import torch.distributed as dist\nimport torch\n"
        "from torch.distributed import all_reduce as ar\n"
        "dist.all_reduce(t)\ntorch.distributed.broadcast(t, 0)\nar(t)\nnorm.full_tensor()\n"
        "dist.get_world_size()\n"
    )
    assert len(raw_collectives(source)) == 5  # the import, then four calls; get_world_size is none


def test_no_collective_bypasses_the_helper():
    offenders = {}
    for path in sorted(SRC.rglob("*.py")):
        if path == HELPER:
            continue
        found = raw_collectives(path.read_text(encoding="utf-8"))
        if found:
            offenders[str(path.relative_to(SRC))] = found
    assert offenders == {}, (
        "collectives outside scaletrain/distributed/collectives.py (route them through it, so "
        f"CPU tensors never reach an NCCL-only group): {offenders}"
    )


def test_without_a_group_every_collective_is_the_identity():
    tensor = torch.tensor([1.0, 2.0])
    assert collectives.all_reduce(tensor, "mean") is tensor and tensor.tolist() == [1.0, 2.0]
    assert collectives.all_gather_object({"a": 1}) == [{"a": 1}]
    assert collectives.broadcast_object("x") == "x"
    assert collectives.world_size() == 1


class _CudaOnlyGroup:
    _device_types = [torch.device("cuda")]


def test_a_tensor_on_a_device_its_group_cannot_take_is_moved(monkeypatch):
    monkeypatch.setattr(collectives, "active", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert collectives.device_for(torch.device("cpu"), _CudaOnlyGroup()) == torch.device("cuda", 3)
    assert collectives.device_for(torch.device("cuda", 1), _CudaOnlyGroup()) == torch.device("cuda", 1)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_one_worker_with_a_data_parallel_strategy_runs_in_a_process_group(tmp_path, strategy):
    """ddp/fsdp with workers: 1 get a real group of one rank (in this process: nothing listens),
    with the same weights as the single strategy."""
    job = toy_job(tmp_path, train={"max_steps": 8, "eval_every": 4, "clip_grad_norm": 1.0},
                  checkpoint={"every_steps": 4})
    single = scaletrain.run({**job, "scale": {"workers": 1, "strategy": "single"}})
    grouped = scaletrain.run({**job, "scale": {"workers": 1, "strategy": strategy}})
    assert grouped["status"] == "finished" and grouped["strategy"] == strategy
    assert grouped["weights_sha256"] == single["weights_sha256"]
    log = Path(grouped["run_dir"], "logs", "worker-0.jsonl").read_text()
    assert '"backend": "gloo"' in log
    assert not torch.distributed.is_initialized()  # destroyed at the end
    from safetensors.torch import load_file

    assert state_dict_sha256(load_file(Path(grouped["run_dir"], "model.safetensors"))) == single["weights_sha256"]
