"""What a model needs, measured without training it: parameter shapes (built on the meta
device: no memory, no weights), activation bytes and FLOPs per sample (one forward/backward
pass counting the tensors autograd saves), or the same from a transformer's shape.

Activations are measured on the CPU with real tensors when the model fits easily in memory
(exact for these kernels), else on the meta device (the meta kernels save slightly
different tensors: measured +10-20% on tiny_gpt). Per-sample bytes are the difference
between batches of 2 and 1 samples, so fixed costs do not scale with the batch.
"""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.data import default_collate

from scaletrain.data.stream import is_stream
from scaletrain.plan.state_bytes import ParamShape
from scaletrain.strategies.blocks import find_blocks

__all__ = ["ModelProfile", "ActivationProfile", "profile_task", "profile_transformer", "profile_params"]

REAL_PASS_LIMIT_BYTES = 2 * 1024**3  # above this, the activation pass runs on the meta device


@dataclass
class ActivationProfile:
    """Saved-for-backward bytes: ``fixed + per_sample * batch``; with activation
    checkpointing: block inputs plus the largest block's own, recomputed one at a time."""

    per_sample: float
    fixed: float
    ac_per_sample: float
    ac_fixed: float
    measured_on: str  # cpu | meta | formula

    def bytes(self, batch: int, checkpointing: bool = False) -> float:
        if checkpointing:
            return self.ac_fixed + self.ac_per_sample * batch
        return self.fixed + self.per_sample * batch


@dataclass
class ModelProfile:
    name: str
    shapes: list[ParamShape]  # trainable parameters
    buffer_bytes: int
    block_shapes: list[list[ParamShape]] = field(default_factory=list)
    activations: ActivationProfile | None = None
    flops_per_sample: float | None = None  # forward + backward
    sample: str = "sample"
    cpu_seconds: tuple[float, float] | None = None  # measured forward+backward on this CPU: (fixed, per sample)
    cpu_optimizer_seconds: float | None = None  # measured optimizer step on every parameter, on this CPU
    assumed_blocks: str | None = None  # what was assumed about the blocks when the shape is unknown

    @property
    def params(self) -> int:
        return sum(s.rows * s.row_numel for s in self.shapes)

    @property
    def param_bytes(self) -> int:
        return sum(s.nbytes for s in self.shapes)

    @property
    def largest_block_bytes(self) -> int:
        return max((sum(s.nbytes for s in block) for block in self.block_shapes), default=0)

    @property
    def root_bytes(self) -> int:
        """Parameters outside every block (embeddings, head): FSDP's root unit."""
        return self.param_bytes - sum(s.nbytes for block in self.block_shapes for s in block)


def profile_task(task: Any, name: str, precision: str = "fp32", real_pass: bool | None = None,
                 count_flops: bool = True, batch: int = 8, optimizer: str = "adamw",
                 timed: bool | None = None) -> ModelProfile:
    """``real_pass``: measure activations with real tensors (default: when the model is
    small enough to build on the CPU), else on the meta device. ``timed``: a real pass is also
    timed, forward and backward at 1 and ``batch`` samples and a step of ``optimizer``, for CPU
    step times (default: on a machine without CUDA; GPU step times come from FLOPs, and timing
    a 100M-parameter model on one CPU thread takes minutes)."""
    with torch.device("meta"):
        meta_model = task.build_model()
    shapes = [ParamShape.of(p) for p in meta_model.parameters() if p.requires_grad]
    blocks = find_blocks(meta_model, task)
    profile = ModelProfile(
        name=name,
        shapes=shapes,
        buffer_bytes=sum(b.nbytes for b in meta_model.buffers()),
        block_shapes=[[ParamShape.of(p) for p in b.parameters() if p.requires_grad] for b in blocks],
    )
    real = sum(s.nbytes for s in shapes) <= REAL_PASS_LIMIT_BYTES if real_pass is None else real_pass
    device = "cpu" if real else "meta"
    if real:
        torch.manual_seed(0)
        model = task.build_model()
        blocks = find_blocks(model, task)
    else:
        model = meta_model
    dataset = task.train_dataset()
    collate = getattr(task, "collate", None) or default_collate
    passes = {}
    for batch in (1, 2):
        samples = collate(_first_samples(dataset, batch))
        passes[batch] = _saved_bytes(model, blocks, task.loss, _to(samples, device), precision, device, count_flops)
    one, two = passes[1], passes[2]
    if timed is None:
        timed = not torch.cuda.is_available()
    if real and timed:  # small models spend their step in per-op overhead FLOPs do not show
        timed = max(2, len(_first_samples(dataset, batch)))  # type: ignore[assignment]  # from here on: the largest batch timed
        times = {b: _fwd_bwd_seconds(model, task.loss, collate(_first_samples(dataset, b))) for b in (1, timed)}
        per = max(0.0, (times[timed] - times[1]) / (timed - 1))
        profile.cpu_seconds = (max(0.0, times[1] - per), per)
        profile.cpu_optimizer_seconds = _optimizer_step_seconds(model, optimizer)
    per_sample = two["total"] - one["total"]
    ac_per_sample = two["checkpointed"] - one["checkpointed"]
    profile.activations = ActivationProfile(
        per_sample=per_sample,
        fixed=max(0.0, one["total"] - per_sample),
        ac_per_sample=ac_per_sample,
        ac_fixed=max(0.0, one["checkpointed"] - ac_per_sample),
        measured_on=device,
    )
    profile.flops_per_sample = two["flops"] / 2 if two["flops"] else None
    return profile


def _fwd_bwd_seconds(model: nn.Module, loss_fn: Any, batch: Any) -> float:
    """On one thread, what a CPU worker gets when workers fill the cores."""

    def once() -> None:
        out = loss_fn(model, batch)
        (out[0] if isinstance(out, tuple) else out).backward()

    seconds = _typical_time(once)
    model.zero_grad(set_to_none=True)
    return seconds


def _typical_time(call: Any, budget_s: float = 1.0, least: int = 3, most: int = 20) -> float:
    """Median wall time of ``call`` on one thread after a warm-up call (a training step's
    typical time, not its best): ``least`` to ``most`` repeats, stopping once ``budget_s``
    is spent."""
    import statistics
    import time

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        call()
        times: list[float] = []
        while len(times) < least or (len(times) < most and sum(times) < budget_s):
            started = time.perf_counter()
            call()
            times.append(time.perf_counter() - started)
        return statistics.median(times)
    finally:
        torch.set_num_threads(threads)


def _optimizer_step_seconds(model: nn.Module, name: str) -> float | None:
    """An optimizer step and zeroing the gradients, on one thread."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        return None
    if name == "adamw":
        optimizer: torch.optim.Optimizer = torch.optim.AdamW(params, lr=1e-12)
    elif name == "sgd":
        optimizer = torch.optim.SGD(params, lr=1e-12, momentum=0.9)
    else:
        return None

    def once() -> None:
        for p in params:
            p.grad = torch.zeros_like(p)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return _typical_time(once)


def _to(batch: Any, device: str) -> Any:
    from torch.utils._pytree import tree_map

    return tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, batch)


def _saved_bytes(model: nn.Module, blocks: list[nn.Module], loss_fn: Any, batch: Any, precision: str, device: str,
                 count_flops: bool = True) -> dict[str, float]:
    """One forward (and backward on real tensors): bytes autograd saved, in total and per block,
    the bytes entering each block, and the FLOPs counted."""
    from torch.utils.flop_counter import FlopCounterMode

    param_storages = {p.untyped_storage()._cdata for p in model.parameters()}
    saved: dict[int, tuple[int, int]] = {}  # storage -> (bytes, block index or -1)
    current = [-1]
    inputs = [0] * len(blocks)
    handles = []
    for index, block in enumerate(blocks):
        def enter(module, args, index=index):
            current[0] = index
            inputs[index] += sum(a.untyped_storage().nbytes() for a in args if isinstance(a, torch.Tensor))

        def leave(module, args, output):
            current[0] = -1

        handles += [block.register_forward_pre_hook(enter), block.register_forward_hook(leave)]

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage._cdata not in param_storages and storage._cdata not in saved:
            saved[storage._cdata] = (storage.nbytes(), current[0])
        return tensor

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    autocast = torch.autocast(device_type="cpu", dtype=dtype) if dtype and device == "cpu" else contextlib.nullcontext()
    model.train()
    counter = FlopCounterMode(display=False) if count_flops else None
    counting = counter if counter is not None else contextlib.nullcontext()
    try:
        with counting, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
            out = loss_fn(model, batch)
            loss = out[0] if isinstance(out, tuple) else out
        if device != "meta":
            with counting:
                loss.backward()
            model.zero_grad(set_to_none=True)
    finally:
        for handle in handles:
            handle.remove()
    total = sum(size for size, _ in saved.values())
    per_block = [0] * len(blocks)
    for size, index in saved.values():
        if index >= 0:
            per_block[index] += size
    checkpointed = total - sum(per_block) + sum(inputs) + max(per_block, default=0)
    flops = float(counter.get_total_flops()) if counter is not None else 0.0
    return {"total": float(total), "checkpointed": float(checkpointed), "flops": flops}


def _first_samples(dataset: Any, count: int) -> list[Any]:
    """The first ``count`` samples (fewer if it has fewer) of a map-style dataset or a stream
    (a fresh iterator: the training run opens its own)."""
    if is_stream(dataset):
        return list(itertools.islice(iter(dataset), count))
    return [dataset[i] for i in range(min(count, len(dataset)))]


def profile_transformer(layers: int, hidden: int, heads: int, vocab: int, seq: int, precision: str = "bf16") -> ModelProfile:
    """A GPT-style decoder from its shape (Korthikanti et al. 2022 for activations, with fused
    attention; 6N FLOPs per token plus attention). Parameters: per layer 12h^2 + 13h (attention, MLP of 4h, two
    norms), token and position embeddings, final norm; the head tied to the embedding."""
    itemsize = 4  # master weights in fp32
    layer = [ParamShape(3 * hidden, hidden, itemsize), ParamShape(1, 3 * hidden, itemsize),
             ParamShape(hidden, hidden, itemsize), ParamShape(1, hidden, itemsize),
             ParamShape(4 * hidden, hidden, itemsize), ParamShape(1, 4 * hidden, itemsize),
             ParamShape(hidden, 4 * hidden, itemsize), ParamShape(1, hidden, itemsize),
             ParamShape(1, 2 * hidden, itemsize), ParamShape(1, 2 * hidden, itemsize)]
    root = [ParamShape(vocab, hidden, itemsize), ParamShape(seq, hidden, itemsize), ParamShape(1, 2 * hidden, itemsize)]
    blocks = [list(layer) for _ in range(layers)]
    scale = 1.0 if precision in ("bf16", "fp16") else 2.0  # the formula counts 16-bit activations
    # 34sbh per layer for 16-bit activations; the 5as^2b of attention scores is not stored by
    # fused attention (PyTorch's scaled_dot_product_attention), which every current recipe uses.
    per_layer = seq * hidden * 34 * scale
    act_bytes = 2 if scale == 1.0 else 4
    params = sum(s.rows * s.row_numel for s in root + layer * layers)
    profile = ModelProfile(
        name=f"transformer L{layers} h{hidden} a{heads} V{vocab} s{seq}",
        shapes=root + [s for block in blocks for s in block],
        buffer_bytes=0,
        block_shapes=blocks,
        activations=ActivationProfile(
            per_sample=layers * per_layer + seq * vocab * act_bytes * 2,  # + logits and their softmax
            fixed=0.0,
            ac_per_sample=layers * seq * hidden * act_bytes + per_layer + seq * vocab * act_bytes * 2,
            ac_fixed=0.0,
            measured_on="formula",
        ),
        flops_per_sample=seq * (6 * params + 12 * layers * hidden * seq),
        sample="sequence",
    )
    return profile


# A transformer of L layers and width h has about 12*L*h^2 parameters in its layers; large ones
# keep h near 128*L (GPT-3 6.7B: 32 x 4096; LLaMA 7B: 32 x 4096; 70B: 80 x 8192, 102 per layer).
_WIDTH_PER_LAYER = 128


def profile_params(params: float) -> ModelProfile:
    """Only a parameter count: model state is exact, activations unknown. FSDP gathers a block at
    a time, so the blocks matter: assume a transformer's proportions (said in the plan's notes)."""
    count = int(params)
    layers = max(1, round((count / (12 * _WIDTH_PER_LAYER**2)) ** (1 / 3)))
    size, extra = divmod(count, layers)
    blocks = [[ParamShape(size + (1 if i < extra else 0), 1, 4)] for i in range(layers)]
    note = (f"shape unknown: assumed {layers} equal blocks of {size:,.0f} parameters, nothing outside them "
            f"(a transformer's proportions, 12*L*h^2 with h = {_WIDTH_PER_LAYER}*L); FSDP's gathered "
            "figure depends on it: give --layers/--hidden/--heads, or a job, for the real blocks")
    return ModelProfile(name=f"{count:,} parameters", shapes=[s for block in blocks for s in block],
                        buffer_bytes=0, block_shapes=blocks, flops_per_sample=None, assumed_blocks=note)
