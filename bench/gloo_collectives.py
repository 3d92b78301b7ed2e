"""Which collectives gloo runs on a device's tensors: the ones DDP, FSDP2 and scaletrain issue.

gloo takes CUDA tensors for some collectives (it copies them through pinned host memory) and not
for others; which ones changes between torch releases. bench/gpu_check.py runs this on 2 ranks
sharing one GPU before it trusts a 2-rank gloo job there, and says which collectives are missing.
Each collective runs in a group of its own, so one that fails (or times out) leaves the others'
results intact; the result is checked, not only the absence of an error. Rank 0 prints one JSON
line per collective as soon as it is known, so a crash still leaves the lines before it.

    torchrun --standalone --nproc-per-node 2 bench/gloo_collectives.py --device cuda
"""

import argparse
import json
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

SUM, AVG = dist.ReduceOp.SUM, dist.ReduceOp.AVG


def all_reduce(x, rank, world, group, op=SUM):
    dist.all_reduce(x, op=op, group=group)
    return x


def broadcast(x, rank, world, group):
    dist.broadcast(x, src=0, group=group)
    return x


def all_gather(x, rank, world, group):
    out = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(out, x, group=group)
    return torch.cat(out)


def all_gather_into_tensor(x, rank, world, group):
    out = x.new_empty(world * x.numel())
    dist.all_gather_into_tensor(out, x, group=group)
    return out


def reduce_scatter_tensor(x, rank, world, group, op=SUM):
    out = x.new_empty(x.numel() // world)
    dist.reduce_scatter_tensor(out, x, op=op, group=group)
    return out


def all_reduce_coalesced(x, rank, world, group):
    dist.all_reduce_coalesced([x], group=group)
    return x


# name: (call, what it is for, the expected result from rank r's input of ones * (r + 1))
PROBES = {
    "all_reduce": (all_reduce, "DDP's gradient buckets; scaletrain's metric and norm reductions",
                   lambda world: [world * (world + 1) / 2] * 4),
    "broadcast": (broadcast, "DDP's parameter sync at start", lambda world: [1.0] * 4),
    "all_gather": (all_gather, "gathers of per-rank values", lambda world: [r + 1.0 for r in range(world) for _ in range(4)]),
    "all_gather_into_tensor": (all_gather_into_tensor, "FSDP2's parameter all-gather (unshard)",
                               lambda world: [r + 1.0 for r in range(world) for _ in range(4)]),
    "reduce_scatter_tensor": (reduce_scatter_tensor, "FSDP2's gradient reduce-scatter (sum)",
                              lambda world: [world * (world + 1) / 2] * (4 // world)),
    "reduce_scatter_tensor(avg)": (lambda *a: reduce_scatter_tensor(*a, op=AVG),
                                   "FSDP2's gradient reduce-scatter for fp32/bf16 gradients (average)",
                                   lambda world: [(world + 1) / 2] * (4 // world)),
    "all_reduce(avg)": (lambda *a: all_reduce(*a, op=AVG), "FSDP2's gradient average across replicas",
                        lambda world: [(world + 1) / 2] * 4),
    "all_reduce_coalesced": (all_reduce_coalesced, "not used by scaletrain's paths (for reference)",
                             lambda world: [world * (world + 1) / 2] * 4),
}


def probe(name: str, device: torch.device, rank: int, world: int) -> dict:
    call, used_by, expected = PROBES[name]
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=30))
    x = torch.ones(4, device=device) * (rank + 1)
    try:
        got = call(x, rank, world, group).cpu().tolist()
    except Exception as exc:  # the finding: this collective does not run on this device's tensors
        return {"collective": name, "ok": False, "used_by": used_by,
                "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
    row = {"collective": name, "ok": got == expected(world), "used_by": used_by}
    if not row["ok"]:
        row["error"] = f"wrong result {got}, expected {expected(world)}"
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")  # ranks share GPU 0
    for name in PROBES:
        row = probe(name, device, rank, world)
        if rank == 0:
            sys.stdout.write(json.dumps(row) + "\n")
            sys.stdout.flush()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
