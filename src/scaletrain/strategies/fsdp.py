"""Sharded data parallel with PyTorch's FSDP2 (``fully_shard``): each block, then the root.

fsdp shards parameters, gradients and optimizer state over all workers (a 1-D mesh); hsdp
shards within groups of ``fsdp.shard_size`` workers and replicates across the groups (a 2-D
mesh, ``("replicate", "shard")``), so the all-gathers stay inside a node. Parameters are
DTensors; the loop, the optimizer and DCP checkpoints take them as they are, and checkpoints
load under any strategy and world size.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from scaletrain.distributed.device import Placement
from scaletrain.strategies.base import Strategy

__all__ = ["FSDPStrategy", "HSDPStrategy"]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class FSDPStrategy(Strategy):
    name = "fsdp"
    sharded = True

    def mesh(self, placement: Placement):
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(placement.device.type, (_world_size(),), mesh_dim_names=("shard",))

    def wrap(self, model: nn.Module, placement: Placement, blocks: Sequence[nn.Module] = ()) -> nn.Module:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        options = self.scale.fsdp if self.scale is not None else None
        kwargs = {"mesh": self.mesh(placement)}
        if options is not None:
            param_dtype = DTYPES.get(options.param_dtype) if options.param_dtype else None
            # Gradients are summed in fp32 unless asked otherwise: FSDP2 would reduce them in
            # param_dtype, and a bf16 sum over many ranks loses small gradients.
            reduce = options.reduce_dtype or ("fp32" if param_dtype is not None else None)
            reduce_dtype = DTYPES[reduce] if reduce else None
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
            if options.cpu_offload:
                kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=placement.device.type == "cuda")
        reshard = options.reshard_after_forward if options is not None else True
        # No model.to(device) first: fully_shard moves each block to the mesh's device as it
        # shards it (or keeps it in CPU memory with offload), so no rank ever holds the whole
        # model on its GPU, the case FSDP is chosen for.
        for block in blocks:
            fully_shard(block, reshard_after_forward=reshard, **kwargs)
        # The root's parameters (embeddings, head...) are needed right after its forward ends:
        # keeping them gathered saves an all-gather at the start of backward.
        return fully_shard(model, reshard_after_forward=False, **kwargs)  # type: ignore[return-value]  # fully_shard returns the module, now an FSDPModule too

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))  # type: ignore[return-value]  # full tensors: full_state_dict=True

    def sync_gradients(self, model: nn.Module, sync: bool) -> contextlib.AbstractContextManager:
        return _gradient_sync(model, sync)


class HSDPStrategy(FSDPStrategy):
    name = "hsdp"

    def mesh(self, placement: Placement):
        import os

        from torch.distributed.device_mesh import init_device_mesh

        world = _world_size()
        configured = self.scale.fsdp.shard_size if self.scale is not None else None
        shard = configured or int(os.environ.get("LOCAL_WORLD_SIZE", world))
        if world % shard:
            raise ValueError(f"hsdp: {world} workers do not split into shard groups of {shard}; set scale.fsdp.shard_size")
        return init_device_mesh(
            placement.device.type, (world // shard, shard), mesh_dim_names=("replicate", "shard")
        )


@contextlib.contextmanager
def _gradient_sync(model: nn.Module, sync: bool) -> Iterator[None]:
    """Micro-steps before the last accumulate unreduced gradients (FSDP2's no_sync)."""
    if sync:
        yield
        return
    model.set_requires_gradient_sync(False)  # type: ignore[operator]  # an FSDPModule method, not a tensor
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)  # type: ignore[operator]  # an FSDPModule method, not a tensor


def _world_size() -> int:
    from scaletrain.distributed import collectives

    return collectives.world_size()
