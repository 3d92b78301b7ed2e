"""Which modules FSDP shards one by one and activation checkpointing recomputes."""

import pytest
import torch
from torch import nn

from scaletrain.config.loading import parse_job
from scaletrain.engine.evaluate import eval_batches, evaluate
from scaletrain.errors import ConfigError
from scaletrain.strategies.activation_checkpoint import checkpoint_blocks
from scaletrain.strategies.blocks import find_blocks
from tests.helpers.tasks import toy_job


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.dropout = nn.Dropout(0.5)

    def forward(self, x):
        return self.dropout(torch.tanh(self.linear(x)))


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.heads = nn.ModuleList([nn.Linear(8, 2), nn.Linear(8, 3)])  # mixed sizes, small
        self.layers = nn.ModuleList([Block() for _ in range(3)])

    def forward(self, x):
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.heads[0](x)


def test_the_largest_uniform_module_list_is_the_blocks():
    model = Stack()
    assert find_blocks(model) == list(model.layers)


def test_a_model_without_repeated_layers_has_no_blocks():
    assert find_blocks(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))) == []


def test_the_task_can_name_its_blocks():
    class Task:
        def blocks(self, model):
            return [model.embed, model.layers[0]]

    model = Stack()
    assert find_blocks(model, Task()) == [model.embed, model.layers[0]]


def test_blocks_that_are_not_part_of_the_model_are_refused():
    class Task:
        def blocks(self, model):
            return [nn.Linear(2, 2)]

    with pytest.raises(TypeError, match="submodules of the model"):
        find_blocks(Stack(), Task())


def test_activation_checkpointing_keeps_names_outputs_and_gradients():
    torch.manual_seed(0)
    plain = Stack()
    recomputed = Stack()
    recomputed.load_state_dict(plain.state_dict())
    assert checkpoint_blocks(find_blocks(recomputed)) == 3
    assert list(recomputed.state_dict()) == list(plain.state_dict())  # checkpoints unchanged
    x = torch.randn(5, 4)
    runs = {}
    for label, model in (("plain", plain), ("recomputed", recomputed)):
        runs[label] = 0
        model.layers[0].linear.register_forward_hook(lambda *_, label=label: runs.__setitem__(label, runs[label] + 1))
        torch.manual_seed(1)  # the same dropout masks in both: replayed in the recompute
        model(x).sum().backward()
    assert runs == {"plain": 1, "recomputed": 2}  # forward again in backward
    for (name, a), b in zip(plain.named_parameters(), recomputed.parameters()):
        if name.startswith("heads.1"):  # unused by forward
            assert a.grad is None and b.grad is None
        else:
            assert torch.equal(a.grad, b.grad), name


def test_every_rank_runs_as_many_eval_forwards_as_rank_zero():
    # 65 samples over 2 ranks: 33 and 32; batches of 16: 3 and 2 batches.
    assert [eval_batches(65, 16, 2), eval_batches(64, 16, 2), eval_batches(7, 16, 2)] == [3, 2, 1]
    calls = []

    def loss(model, batch):
        calls.append(len(batch[0]))
        return model(batch[0]).pow(2).mean()

    batches = [(torch.randn(16, 4),), (torch.randn(16, 4),)]
    metrics = evaluate(nn.Linear(4, 1), loss, batches, lambda b: b, torch.no_grad, forwards=3)
    assert calls == [16, 16, 16]  # the last batch again, not counted in the mean
    assert set(metrics) == {"loss"}


def test_hsdp_shard_size_must_divide_the_workers(tmp_path):
    job = toy_job(tmp_path, scale={"workers": 4, "strategy": "hsdp", "fsdp": {"shard_size": 3}})
    with pytest.raises(ConfigError, match=r"hsdp needs workers \(4\) to be a multiple of fsdp.shard_size \(3\)"):
        parse_job(job)
