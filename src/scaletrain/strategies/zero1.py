"""ZeRO-1: data parallel with the optimizer state split over the workers.

DDP keeps a full replica of the parameters and all-reduces the gradients as for ``ddp``; torch's
ZeroRedundancyOptimizer gives each rank the optimizer state of whole parameters (the largest
first, each to the rank holding the fewest elements: plan/state_bytes.py zero_partition), the
rank steps only those, then broadcasts them. For AdamW that is 8 of the 16 bytes a parameter
takes, divided by the number of workers, for one more broadcast of the parameters per step.

Checkpoints keep the layout every other strategy writes (each parameter's optimizer state under
its name, the optimizer's groups beside it), each rank writing the state it owns: a ZeRO-1
checkpoint resumes under ddp, fsdp or single and the other way round, at any worker count.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

from scaletrain.strategies.ddp import DDPStrategy

__all__ = ["Zero1Strategy", "ShardedOptimizer"]


class ShardedOptimizer(ZeroRedundancyOptimizer):
    """ZeroRedundancyOptimizer whose checkpoint state is this rank's whole parameters, by name
    (its own ``state_dict`` would first gather every rank's state on one rank)."""

    @property
    def local_optimizer(self) -> torch.optim.Optimizer:
        return self.optim

    def checkpoint_state(self, model: nn.Module) -> dict[str, Any]:
        """This rank's share, in the layout torch.distributed.checkpoint's get_state_dict gives
        a whole optimizer: {"state": {name: {...}}, "param_groups": [{..., "params": [names]}]}."""
        self._materialize_state()
        names = _names(model)
        state = {names[id(p)]: dict(self.optim.state[p]) for group in self.optim.param_groups
                 for p in group["params"] if p in self.optim.state}
        # Every setting a whole optimizer's groups carry: the local optimizer's (eps, amsgrad...),
        # then the global group's, which the schedule sets (lr, initial_lr) and the next step
        # hands down, with every parameter's name.
        groups = [{**_settings(local), **_settings(group), "params": [names[id(p)] for p in group["params"]]}
                  for group, local in zip(self.param_groups, self.optim.param_groups)]
        return {"state": state, "param_groups": groups}

    def load_checkpoint_state(self, model: nn.Module, loaded: dict[str, Any]) -> None:
        """Take this rank's parameters' state from a checkpoint's (loaded into the template
        checkpoint_state gave), whichever strategy and worker count wrote it."""
        names = _names(model)
        local_groups = self.optim.param_groups
        saved_groups = loaded["param_groups"]
        if len(saved_groups) != len(local_groups):
            raise ValueError(f"the checkpoint has {len(saved_groups)} optimizer groups, this optimizer "
                             f"{len(local_groups)}")
        index, state, groups = 0, {}, []
        for saved, group in zip(saved_groups, local_groups):
            ids = []
            for p in group["params"]:
                if names[id(p)] in loaded["state"]:
                    state[index] = loaded["state"][names[id(p)]]
                ids.append(index)
                index += 1
            groups.append({**{k: v for k, v in saved.items() if k != "params"}, "params": ids})
        self.optim.load_state_dict({"state": state, "param_groups": groups})
        for saved, group in zip(saved_groups, self.param_groups):  # the global groups' settings too
            group.update({k: v for k, v in saved.items() if k != "params"})

    def _materialize_state(self) -> None:
        """Before the first step there is no state to load into: one step with zero gradients
        and a zero learning rate creates it and leaves every parameter as it was (what
        get_state_dict does for a whole optimizer)."""
        params = [p for group in self.optim.param_groups for p in group["params"]]
        missing = {id(p) for p in params if p not in self.optim.state}
        if not missing:
            return
        lrs = [group["lr"] for group in self.optim.param_groups]
        grads = [p.grad for p in params]
        try:
            for group in self.optim.param_groups:
                group["lr"] = 0.0
            # Only the parameters without state take part: a step would advance the others' counters.
            for p in params:
                p.grad = torch.zeros_like(p) if id(p) in missing else None
            self.optim.step()  # this rank's parameters only: nothing to broadcast
        finally:
            for group, lr in zip(self.optim.param_groups, lrs):
                group["lr"] = lr
            for p, grad in zip(params, grads):
                p.grad = grad


def _settings(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


def _names(model: nn.Module) -> dict[int, str]:
    inner = getattr(model, "module", model)  # DDP's wrapper adds nothing to the names
    return {id(p): name for name, p in inner.named_parameters()}


class Zero1Strategy(DDPStrategy):
    name = "zero1"

    def make_optimizer(self, optimizer_class: type[torch.optim.Optimizer], groups: list[dict[str, Any]],
                       **defaults: Any) -> torch.optim.Optimizer:
        return ShardedOptimizer(groups, optimizer_class=optimizer_class, **defaults)
