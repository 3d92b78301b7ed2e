"""A small unsharded state in one safetensors file (checkpoint/single_file.py): what it keeps,
what it refuses, and a forged one refused at resume."""

import hashlib
import json
import struct

import pytest
import torch

import scaletrain
from scaletrain.checkpoint import single_file
from scaletrain.checkpoint.manifest import CheckpointRefused
from scaletrain.errors import ScaletrainError
from tests.helpers.tasks import toy_job


def test_the_state_comes_back_exactly_tuples_none_floats_and_tied_tensors(tmp_path):
    weight = torch.randn(4, 3)
    state = {
        "model": {"a.weight": weight, "b.weight": weight, "bias": torch.zeros(3, dtype=torch.bfloat16)},
        "optim": {"state": {"a.weight": {"step": torch.tensor(3.0), "exp_avg": torch.ones(4, 3)}},
                  "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "foreach": None, "amsgrad": False,
                                    "eps": float("inf"), "params": ["a.weight", "b.weight"]}]},
        "epoch": 2,
        "empty": torch.empty(0),
    }
    assert single_file.fits(state)
    written = single_file.save(state, tmp_path)
    data = (tmp_path / "state.safetensors").read_bytes()
    assert written == {"state.safetensors": (len(data), hashlib.sha256(data).hexdigest())}
    single_file.check(tmp_path / "state.safetensors")
    loaded = single_file.load(tmp_path / "state.safetensors")
    assert loaded["optim"]["param_groups"][0]["betas"] == (0.9, 0.999)  # a tuple, not a list
    assert loaded["optim"]["param_groups"][0]["foreach"] is None
    assert loaded["optim"]["param_groups"][0]["eps"] == float("inf")
    assert loaded["epoch"] == 2
    for key in ("a.weight", "b.weight"):  # tied in the model: both come back, equal
        assert torch.equal(loaded["model"][key], weight)
    assert loaded["model"]["bias"].dtype == torch.bfloat16
    assert torch.equal(loaded["optim"]["state"]["a.weight"]["step"], torch.tensor(3.0))
    assert loaded["empty"].shape == (0,)


@pytest.mark.parametrize("state", [
    {"model": {1: torch.zeros(1)}},  # a key JSON cannot keep as it is
    {"model": {"w": torch.zeros(2).to_sparse()}},
    {"fn": print},
    {"big": torch.zeros(2 << 20)},  # 8 MiB, over the limit below
])
def test_what_one_file_cannot_keep_goes_to_dcp(state):
    assert not single_file.fits(state, limit=4 << 20)


def _forge(path, structure):
    """A state.safetensors whose header's structure is replaced (what anyone can write)."""
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    header["__metadata__"]["scaletrain.structure"] = json.dumps(structure)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    path.write_bytes(struct.pack("<Q", len(head)) + head + data[8 + length:])


@pytest.mark.parametrize("structure", [
    {"x": "no-such-tensor"},
    {"v": {"__reduce__": ["os.system", ["true"]]}},
    {"q": 1},
    [1, 2],
])
def test_a_structure_scaletrain_never_writes_is_refused(tmp_path, structure):
    single_file.save({"w": torch.ones(2)}, tmp_path)
    _forge(tmp_path / "state.safetensors", structure)
    with pytest.raises(CheckpointRefused, match=r"^state\.safetensors is not a state scaletrain writes .*: refused$"):
        single_file.check(tmp_path / "state.safetensors")


def test_resume_refuses_a_forged_state_file_with_matching_hashes(tmp_path):
    summary = scaletrain.run(toy_job(tmp_path, train={"max_steps": 5}))
    checkpoint = tmp_path / "runs" / "toy" / summary["run_id"] / "checkpoints" / "step-00000005"
    _forge(checkpoint / "state.safetensors", {"x": "no-such-tensor"})
    data = (checkpoint / "state.safetensors").read_bytes()
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    manifest["files"]["state.safetensors"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ScaletrainError, match=r"step-00000005 refused: state\.safetensors is not a state scaletrain writes"):
        scaletrain.resume(summary["run_dir"], ["train.max_steps=6"])


class _Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(5, 3)
        self.norm = torch.nn.LayerNorm(3)
        self.head = torch.nn.Linear(3, 5, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("seen", torch.ones(2))

    def forward(self, x):
        return self.head(self.norm(self.emb(x)))


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return a == b


def test_the_whole_state_without_dcp_is_what_dcps_get_state_dict_gives():
    """A tied parameter, a buffer, two groups, a schedule's initial_lr, a parameter not stepped."""
    from scaletrain.checkpoint import dcp_io
    from scaletrain.checkpoint.state import ModelAndOptimizer

    torch.manual_seed(0)
    model = _Tied()
    optimizer = torch.optim.AdamW([{"params": [model.emb.weight], "weight_decay": 0.1},
                                   {"params": [model.norm.weight, model.norm.bias], "weight_decay": 0.0}])
    torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5)
    model.norm.bias.requires_grad_(False)  # no gradient, no optimizer state
    model(torch.tensor([1, 2])).sum().backward()
    optimizer.step()
    state = ModelAndOptimizer(model, optimizer)
    ours, dcps = state.whole_state(), dcp_io.state_of(model, optimizer)
    assert list(ours["optim"]["state"]) == ["emb.weight", "norm.weight"]
    assert _same(ours, dcps)
