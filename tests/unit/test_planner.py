"""The planner: model profiles (exact state bytes, activations within 10%), strategies'
memory and communication, the recommendation and the CLI's one-line errors."""

import json
import sys

import pytest
import torch
from torch.utils.data import default_collate

from scaletrain.engine.state_bytes import measure_state_bytes
from scaletrain.plan import plan_what_if
from scaletrain.plan.estimate import make_plan, state_bytes_per_rank
from scaletrain.plan.hardware import named_gpu
from scaletrain.plan.model_profile import profile_task
from tests.helpers.measure import saved_tensor_bytes
from tests.helpers.run import REPO, scaletrain_cli

sys.path.insert(0, str(REPO / "examples"))
from digits import DigitsTask  # noqa: E402
from tiny_gpt import TinyGPTTask  # noqa: E402

TASKS = {
    "digits": lambda: DigitsTask(hidden=128, dropout=0.1),
    "tiny_gpt": lambda: TinyGPTTask(layers=2, dim=64, heads=4, context=32, vocab=32),
}


@pytest.mark.parametrize("name", sorted(TASKS))
def test_state_bytes_match_the_real_model_and_optimizer_exactly(name):
    task = TASKS[name]()
    profile = profile_task(task, name)
    model = task.build_model()
    optimizer = torch.optim.AdamW(model.parameters())
    out = task.loss(model, default_collate([task.train_dataset()[i] for i in range(4)]))
    (out[0] if isinstance(out, tuple) else out).backward()
    optimizer.step()
    measured = measure_state_bytes(model, optimizer)
    assert state_bytes_per_rank(profile, 1, 0, "adamw", 0.0) == {k: measured[k] for k in ("params", "grads", "optimizer")}
    assert profile.params == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", sorted(TASKS))
@pytest.mark.parametrize("batch", [8, 32])
def test_activation_estimate_is_within_10_percent_of_the_saved_tensors(name, batch):
    task = TASKS[name]()
    profile = profile_task(task, name)
    torch.manual_seed(0)
    measured = saved_tensor_bytes(task, task.build_model(), batch)
    estimate = profile.activations.bytes(batch)
    assert abs(estimate - measured) <= 0.10 * measured, (estimate, measured)


def test_sharding_divides_state_and_adds_the_gathered_blocks():
    profile = profile_task(TASKS["tiny_gpt"](), "tiny_gpt")
    hardware = named_gpu("H100", devices_per_node=4)
    plan = make_plan(profile, hardware, batch=8)
    rows = {e.option.label: e for e in plan.estimates}
    ddp, fsdp = rows["ddp"], rows["fsdp"]
    assert ddp.memory["optimizer"] == state_bytes_per_rank(profile, 1, 0, "adamw", 0.0)["optimizer"]
    assert fsdp.memory["optimizer"] == state_bytes_per_rank(profile, 4, 0, "adamw", 0.0)["optimizer"]
    assert fsdp.memory["optimizer"] < ddp.memory["optimizer"] / 3
    # All-reduce moves 2(n-1)/n of the gradients; FSDP all-gathers twice and reduce-scatters once.
    grads = profile.param_bytes
    assert ddp.comm_bytes["intra_node"] == pytest.approx(2 * 3 / 4 * grads)
    assert fsdp.comm_bytes["intra_node"] == pytest.approx(3 / 4 * 3 * grads)


def test_a_7b_what_if_on_8_h100_needs_sharding_and_says_why():
    plan = plan_what_if(shape={"layers": 32, "hidden": 4096, "heads": 32, "vocab": 32000, "seq": 4096},
                        batch=1, hardware={"gpu": "H100", "devices_per_node": 8})
    assert plan.model["params"] == pytest.approx(6.6e9, rel=0.05)
    rows = {e.option.label: e for e in plan.estimates}
    assert not rows["ddp"].fits  # 16 bytes per parameter of model state alone is over 80 GB
    state = rows["ddp"].memory["params"] + rows["ddp"].memory["grads"] + rows["ddp"].memory["optimizer"]
    assert state == pytest.approx(16 * plan.model["params"], rel=0.001)  # fp32 weights, grads, 2 Adam moments
    assert plan.recommended.option.strategy == "fsdp" and plan.recommended.fits
    assert "a full replica needs" in plan.reason


def test_zero1_when_a_replica_fits_once_the_optimizer_state_is_split():
    # 5e9 parameters: 80 GB of fp32 model state per replica, over 90% of an H100; ZeRO-1 on 8
    # keeps the weights and gradients (40 GB) and an eighth of AdamW's 40 GB.
    plan = plan_what_if(params=5e9, batch=1, hardware={"gpu": "H100", "devices_per_node": 8})
    rows = {e.option.label: e for e in plan.estimates}
    assert not rows["ddp"].fits and rows["zero1"].fits
    # Whole parameters per rank: the shape is unknown, so 29 equal blocks; the fullest rank has 4.
    assert "assumed 29 equal blocks" in plan.notes[0]
    assert rows["zero1"].memory["optimizer"] == pytest.approx(8 * 5e9 * 4 / 29, rel=1e-6)
    assert rows["zero1"].comm_bytes["intra_node"] > rows["ddp"].comm_bytes["intra_node"]  # the broadcast
    assert plan.recommended.option.label == "zero1"
    assert plan.reason.startswith("zero1: a full replica fits once the optimizer state is split over 8 ranks")


def test_a_small_model_on_one_gpu_is_single():
    plan = plan_what_if(params=1e8, batch=8, hardware={"gpu": "A100", "devices_per_node": 1})
    assert plan.recommended.option.label == "single"
    assert plan.reason.startswith("one process is enough")
    assert any("activations unknown" in note for note in plan.notes)


def test_a_parameter_count_alone_shows_the_states_at_rest_apart_from_the_gather():
    # 7.5e9 parameters on 64 V100s: 16 bytes a parameter at rest, over 64 ranks; the all-gather
    # is a block or two at a time, not the whole model (which was priced as 16.9 GB a device).
    plan = plan_what_if(params=7.5e9, batch=1, hardware={"gpu": "V100", "devices_per_node": 8, "nodes": 8})
    fsdp = {e.option.label: e for e in plan.estimates}["fsdp"]
    at_rest = fsdp.memory["params"] + fsdp.memory["grads"] + fsdp.memory["optimizer"]
    assert at_rest == pytest.approx(16 * 7.5e9 / 64, rel=1e-6)  # 1.9 GB
    block = 4 * 7.5e9 / 34  # fp32 bytes of the largest of 34 equal blocks
    # bf16 (the what-if's default): two blocks gathered in flight at half size, one block's fp32 gradients
    assert fsdp.memory["gathered"] == pytest.approx(2 * block / 2 + block, rel=1e-6)
    assert fsdp.memory["total"] < 5e9
    assert plan.notes[0].startswith("shape unknown: assumed 34 equal blocks of 220,588,235 parameters")
    ddp = {e.option.label: e for e in plan.estimates}["ddp"]
    assert ddp.memory["gathered"] == 0


@pytest.mark.parametrize("columns", [80, 200])
def test_plan_reads_at_80_columns_and_whole_on_a_wide_terminal(columns):
    args = ("plan", "--layers", "32", "--hidden", "4096", "--heads", "32", "--seq", "4096", "--gpu", "H100",
            "--devices-per-node", "8")
    out = scaletrain_cli(*args, env={"COLUMNS": str(columns)})
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert max(map(len, lines)) <= columns and "…" not in out.stdout, out.stdout
    (fsdp,) = [line for line in lines if line.lstrip(" │").startswith("* fsdp")]
    # The states at rest (params 3.08 + grads 3.08 + optimizer 6.15 GiB) apart from the blocks
    # gathered for compute (13.03 GiB, transient): the same 42.82 GiB in all.
    if columns == 80:  # state = params + grads + optimizer + buffers, in GiB, one decimal
        assert fsdp.split()[3:8] == ["8", "12.3", "13.0", "17.5", "42.8"], fsdp
    else:
        assert "3.08 GiB" in fsdp and "13.03 GiB" in fsdp and "42.82 GiB" in fsdp, fsdp


def test_plan_cli_json_and_bad_input():
    out = scaletrain_cli("plan", "--params", "7e9", "--gpu", "H100", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["recommended"] and data["hardware"]["name"] == "H100"
    bad = scaletrain_cli("plan", "--gpu", "H900", "--params", "1e9")
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == [
        "error: unknown GPU 'H900'; known: H200, H100, A100, L40S, L4, A10, V100, T4 (or give --memory-gb and --tflops)"]
    nothing = scaletrain_cli("plan")
    assert nothing.returncode == 2
    assert nothing.stderr.strip().splitlines() == [
        "error: give a job file, --params N, or a transformer shape (--layers --hidden --heads)"]


def test_auto_picks_ddp_when_a_replica_fits_zero1_when_split_state_does_and_fsdp_when_only_shards_do():
    from scaletrain.config.loading import load_job
    from scaletrain.plan.auto import resolve_auto_strategy
    from scaletrain.plan.hardware import Hardware

    job = load_job(REPO / "examples" / "digits.yaml", [])
    task = TASKS["digits"]()
    assert resolve_auto_strategy(job, task, 2, torch.device("cpu"), False).scale.strategy == "ddp"
    assert resolve_auto_strategy(job, task, 1, torch.device("cpu"), False).scale.strategy == "single"

    profile = profile_task(TASKS["tiny_gpt"](), "tiny_gpt")
    rows = {e.option.label: e for e in make_plan(profile, named_gpu("H100", 4), batch=32).estimates}
    assert rows["fsdp"].memory["total"] < rows["zero1"].memory["total"] < rows["ddp"].memory["total"]
    between = (rows["zero1"].memory["total"] + rows["ddp"].memory["total"]) / 2 / 0.9
    plan = make_plan(profile, Hardware("cuda", "small", 4, 1, between, 1.0, 1.0, 1.0), batch=32, every_device=True)
    assert {e.option.world for e in plan.estimates} == {4}
    assert plan.recommended.option.strategy == "zero1"
    assert plan.reason.startswith("zero1: a full replica fits once the optimizer state is split over 4 ranks")
    between = (rows["fsdp"].memory["total"] + rows["zero1"].memory["total"]) / 2 / 0.9
    plan = make_plan(profile, Hardware("cuda", "small", 4, 1, between, 1.0, 1.0, 1.0), batch=32, every_device=True)
    assert plan.recommended.option.strategy == "fsdp" and not rows["zero1"].memory["total"] <= 0.9 * between
    assert plan.reason.startswith(plan.recommended.option.label + ": a full replica needs")


def test_collective_calls_per_step_and_their_cost_on_a_cpu():
    """tiny_gpt (2 blocks and parameters outside them) on 2 ranks: DDP sends one bucket; FSDP
    gathers each block in forward and again in backward, reduce-scatters it, gathers and
    reduces the root once, and all-reduces the gradient norm. On CPU workers, where each call
    costs milliseconds, that makes FSDP the slower one (measured: bench/results/latest/strategies.json)."""
    from scaletrain.plan.hardware import CPU_COLLECTIVE_S, Hardware

    profile = profile_task(TASKS["tiny_gpt"](), "tiny_gpt")
    assert len(profile.block_shapes) == 2 and profile.root_bytes > 0
    cpu = Hardware("cpu", "2 workers", 2, 1, 8 * 1024**3, 1e10, 2e9, 1e9, collective_s=CPU_COLLECTIVE_S)
    rows = {e.option.label: e for e in make_plan(profile, cpu, batch=32).estimates}
    assert (rows["single"].collectives, rows["ddp"].collectives) == (0, 1)
    assert rows["fsdp"].collectives == 2 * 3 + 2 + 1
    assert rows["fsdp (no reshard)"].collectives == 2 * 2 + 2 + 1
    assert rows["fsdp"].comm_s > 9 * CPU_COLLECTIVE_S
    assert rows["fsdp"].step_s > rows["ddp"].step_s > rows["single"].step_s / 2
    assert rows["fsdp"].samples_per_s < rows["ddp"].samples_per_s


def test_cpu_offload_must_fit_in_host_memory():
    """20e9 parameters on 2 H100s: AdamW state (320 GB) fits nowhere on the devices; offloaded it
    fits a node with 512 GiB of host memory, not one with 200 GiB."""
    roomy = plan_what_if(params=20e9, hardware={"gpu": "H100", "devices_per_node": 2})
    assert roomy.recommended is not None and roomy.recommended.option.cpu_offload
    small_host = plan_what_if(params=20e9, hardware={"gpu": "H100", "devices_per_node": 2, "host_memory_bytes": 200 * 1024**3})
    assert small_host.recommended is None
    assert small_host.reason.startswith("nothing fits: fsdp +offload fits on the devices but keeps 298.02 GiB per node on the host")
    out = scaletrain_cli("plan", "--params", "20e9", "--gpu", "H100", "--devices-per-node", "2", "--host-memory-gb", "200", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["recommended"] is None
