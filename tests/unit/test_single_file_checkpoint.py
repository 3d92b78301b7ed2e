"""A small unsharded state in one safetensors file (checkpoint/single_file.py): what it keeps,
what it refuses, and a forged one refused at resume."""

import hashlib
import json
import struct

import blake3
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
    assert written == {"state.safetensors": (len(data), blake3.blake3(data).hexdigest())}
    single_file.check(tmp_path / "state.safetensors")
    from safetensors.torch import load_file  # the file is safetensors' own format, read by the library alone
    assert sorted(load_file(tmp_path / "state.safetensors")) == [str(i) for i in range(6)]
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


def test_one_process_keeps_a_state_of_any_size_in_one_file(tmp_path, monkeypatch):
    """With one rank there is no parallel write for DCP to win: the size limit is for several."""
    monkeypatch.setattr(single_file, "SMALL_STATE_BYTES", 64)
    summary = scaletrain.run(toy_job(tmp_path, train={"max_steps": 5}))
    folder = tmp_path / "runs" / "toy" / summary["run_id"] / "checkpoints" / "step-00000005"
    assert sorted(p.name for p in folder.iterdir()) == ["manifest.json", "state.safetensors", "trainer.json"]
    assert not single_file.fits(single_file.load(folder / "state.safetensors"), single_file.SMALL_STATE_BYTES)


def _stepped(order=None):
    torch.manual_seed(0)
    model = _Tied()
    params = [model.emb.weight, model.norm.weight, model.norm.bias]
    groups = [{"params": params[:1], "weight_decay": 0.1}, {"params": params[1:], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups if order is None else [groups[i] for i in order], lr=0.01)
    model.norm.bias.requires_grad_(False)  # never stepped: no optimizer state
    for _ in range(2):
        model(torch.tensor([1, 2])).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def _lists(item):
    if isinstance(item, dict):
        return {k: _lists(v) for k, v in item.items()}
    return [_lists(v) for v in item] if isinstance(item, (list, tuple)) else item


def _fresh(order=None):
    model = _Tied()
    model.norm.bias.requires_grad_(False)
    params = [model.emb.weight, model.norm.weight, model.norm.bias]
    groups = [{"params": params[:1], "weight_decay": 0.1}, {"params": params[1:], "weight_decay": 0.0}]
    return model, torch.optim.AdamW(groups if order is None else [groups[i] for i in order], lr=0.01)


@pytest.mark.parametrize("order", [None, (1, 0)])
def test_a_whole_state_loads_without_dcp_as_dcps_set_state_dict_loads_it(tmp_path, order):
    """The load puts back what DCP's set_state_dict puts back; groups in another order than the
    saved ones go through DCP (it matches them by name)."""
    from scaletrain.checkpoint import dcp_io
    from scaletrain.checkpoint.state import ModelAndOptimizer

    original = _stepped()
    single_file.save(ModelAndOptimizer(*original).whole_state(), tmp_path)
    ours, dcps = _fresh(order), _fresh(order)
    direct = ModelAndOptimizer(*ours)._load_whole_state(single_file.load(tmp_path / "state.safetensors"))
    assert direct is (order is None)
    if not direct:
        ModelAndOptimizer(*ours).load_dcp_state(single_file.load(tmp_path / "state.safetensors"), full=True)
    dcp_io.set_state(*dcps, single_file.load(tmp_path / "state.safetensors"), full=True)
    assert _same(ours[0].state_dict(), dcps[0].state_dict())
    assert _same(_lists(ours[1].state_dict()), _lists(dcps[1].state_dict()))  # DCP gives tuples back as lists
    if direct:  # exactly the saved optimizer's, tuples and all
        assert _same(ours[1].state_dict(), original[1].state_dict())
    assert len(ours[1].state) == 2  # emb.weight and norm.weight; the bias was never stepped
    for model, optimizer in (ours, dcps):  # and both train on alike
        model(torch.tensor([3])).sum().backward()
        optimizer.step()
    assert _same(ours[0].state_dict(), dcps[0].state_dict())
