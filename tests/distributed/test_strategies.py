"""Same numbers whatever the strategy: single, DDP, ZeRO-1, FSDP2 (with and without gradient
accumulation) and HSDP (2 replicas of 1 shard on 2 workers, and a 2x2 mesh on 4) on the tiny_gpt
example (gloo workers), checkpoints that move between strategies and train on, recovery under FSDP.

Tolerance for losses: relative 1e-5 per step over 20 steps. DDP all-reduces gradients, FSDP
reduce-scatters them and a single process sums one batch of twice the size: the same
arithmetic in another order, so float32 rounding differs in the last bits (measured: 1e-7).
FSDP's options: CPU offload with the blocks kept gathered between forward and backward is the
same arithmetic (1e-5 too); bf16 parameters for compute (fp32 master weights and gradient
reduction) round every matmul input to 8 bits of mantissa: 2% per step (measured: 0.7%).
"""

import pytest

import scaletrain
from scaletrain.recovery.faults import FAULT_ENV
from tests.helpers.run import REPO, assert_weights_close, read_metrics, state_bytes_by_rank

pytestmark = pytest.mark.distributed

JOB = str(REPO / "examples" / "tiny_gpt.yaml")
STEPS = 20
REL_TOL = 1e-5
BF16_REL_TOL = 2e-2


def tiny_gpt(root, strategy, workers=2, *extra):
    per_worker = 64 // workers  # the same global batch of 64 sequences for every layout
    return [
        f"run_dir={root / strategy}", f"scale.strategy={strategy}", f"scale.workers={workers}",
        f"data.batch_size={per_worker}", f"train.max_steps={STEPS}", "train.log_every=1",
        "train.eval_every=10", "checkpoint.every_steps=10", "tracking.enabled=false", *extra,
    ]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("strategies")
    return {
        "single": scaletrain.run(JOB, tiny_gpt(root, "single", 1)),
        "ddp": scaletrain.run(JOB, tiny_gpt(root, "ddp")),
        # DDP with the optimizer state split over the 2 workers
        "zero1": scaletrain.run(JOB, tiny_gpt(root, "zero1")),
        "fsdp": scaletrain.run(JOB, tiny_gpt(root, "fsdp")),
        # 2 replicas of 1 shard each on a 2-D mesh, recomputing each block's activations
        "hsdp": scaletrain.run(JOB, tiny_gpt(
            root, "hsdp", 2, "scale.fsdp.shard_size=1", "scale.activation_checkpointing=true")),
        "fsdp_offload": scaletrain.run(JOB, tiny_gpt(
            root / "offload", "fsdp", 2, "scale.fsdp.cpu_offload=true", "scale.fsdp.reshard_after_forward=false")),
        "fsdp_bf16": scaletrain.run(JOB, tiny_gpt(
            root / "bf16", "fsdp", 2, "scale.fsdp.param_dtype=bf16", "scale.fsdp.reduce_dtype=fp32")),
        # 2 micro-batches of 16 per optimizer step: gradients accumulate on the sharded parameters
        "fsdp_accum": scaletrain.run(JOB, tiny_gpt(
            root / "accum", "fsdp", 2, "data.batch_size=16", "train.grad_accum=2")),
        # a real 2-D mesh: 2 shard groups of 2 ranks, each replicating the other
        "hsdp_2x2": scaletrain.run(JOB, tiny_gpt(root / "2x2", "hsdp", 4, "scale.fsdp.shard_size=2")),
    }


def losses(summary):
    return [row["loss"] for row in read_metrics(summary["run_dir"])]


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "fsdp", "hsdp", "fsdp_offload", "fsdp_accum", "hsdp_2x2"])
def test_every_strategy_gives_the_single_process_losses(runs, strategy):
    reference, other = losses(runs["single"]), losses(runs[strategy])
    assert len(reference) == len(other) == STEPS
    for step, (a, b) in enumerate(zip(reference, other), start=1):
        assert b == pytest.approx(a, rel=REL_TOL), f"step {step}: single {a}, {strategy} {b}"
    assert runs[strategy]["eval"]["loss"] == pytest.approx(runs["single"]["eval"]["loss"], rel=REL_TOL)
    assert_weights_close(runs["single"], runs[strategy])
    workers = 4 if strategy == "hsdp_2x2" else 2
    assert runs[strategy]["strategy"] == strategy.split("_")[0] and runs[strategy]["world_size"] == workers


def test_zero1_splits_only_the_optimizer_state_and_trains_ddps_bits(runs):
    assert runs["zero1"]["weights_sha256"] == runs["ddp"]["weights_sha256"]
    measured = state_bytes_by_rank(runs["zero1"]["run_dir"])
    replica = state_bytes_by_rank(runs["ddp"]["run_dir"])[0]
    assert all(sizes["params"] == replica["params"] for sizes in measured.values())
    assert sum(sizes["optimizer"] for sizes in measured.values()) == replica["optimizer"]
    assert max(sizes["optimizer"] for sizes in measured.values()) < 0.6 * replica["optimizer"]


def test_bf16_compute_stays_close_to_fp32_and_is_really_bf16(runs):
    reference, bf16 = losses(runs["single"]), losses(runs["fsdp_bf16"])
    assert len(bf16) == STEPS
    for step, (a, b) in enumerate(zip(reference, bf16), start=1):
        assert b == pytest.approx(a, rel=BF16_REL_TOL), f"step {step}: fp32 {a}, bf16 {b}"
    # Not the fp32 arithmetic: the policy was applied.
    assert max(abs(a - b) / a for a, b in zip(reference, bf16)) > 10 * REL_TOL
    assert runs["fsdp_bf16"]["eval"]["loss"] == pytest.approx(runs["single"]["eval"]["loss"], rel=BF16_REL_TOL)


def test_a_fsdp_checkpoint_loads_under_ddp_and_single_and_back(runs, tmp_path):
    """Resuming at the last step trains nothing: the final weights are the loaded ones."""
    fsdp_checkpoint = f"{runs['fsdp']['run_dir']}/checkpoints/step-{STEPS:08d}"
    under_ddp = scaletrain.resume(fsdp_checkpoint, ["scale.strategy=ddp"])
    under_single = scaletrain.resume(
        fsdp_checkpoint, ["scale.strategy=single", "scale.workers=1", "data.batch_size=64"])
    assert under_ddp["resumed_from_step"] == under_single["resumed_from_step"] == STEPS
    assert under_ddp["weights_sha256"] == runs["fsdp"]["weights_sha256"]
    assert under_single["weights_sha256"] == runs["fsdp"]["weights_sha256"]
    ddp_checkpoint = f"{runs['ddp']['run_dir']}/checkpoints/step-{STEPS:08d}"
    back = scaletrain.resume(ddp_checkpoint, ["scale.strategy=fsdp"])
    assert back["weights_sha256"] == runs["ddp"]["weights_sha256"]


@pytest.mark.parametrize("saved, resumed", [("fsdp", "ddp"), ("ddp", "fsdp"), ("hsdp_2x2", "single"),
                                            ("zero1", "ddp"), ("ddp", "zero1")])
def test_a_checkpoint_of_one_strategy_trains_on_under_another(runs, tmp_path, saved, resumed):
    """Step 10's checkpoint of one layout, trained to 20 under another: the uninterrupted run's
    losses and weights (within float32 rounding: the gradients are summed in another order)."""
    layouts = {"fsdp": ("fsdp", 2, []), "ddp": ("ddp", 2, []), "hsdp_2x2": ("hsdp", 4, ["scale.fsdp.shard_size=2"]),
               "single": ("single", 1, []), "zero1": ("zero1", 2, [])}
    strategy, workers, extra = layouts[saved]
    first = scaletrain.run(JOB, tiny_gpt(tmp_path, strategy, workers, *extra))  # the fixture's run, again
    assert first["weights_sha256"] == runs[saved]["weights_sha256"]
    strategy, workers, _ = layouts[resumed]
    summary = scaletrain.resume(f"{first['run_dir']}/checkpoints/step-00000010", [
        f"scale.strategy={strategy}", f"scale.workers={workers}", f"data.batch_size={64 // workers}"])
    stop = 10
    assert (summary["strategy"], summary["world_size"], summary["resumed_from_step"], summary["steps"]) == (
        strategy, workers, stop, STEPS)
    expected = losses(runs[saved])[stop:]
    trained = [row["loss"] for row in read_metrics(summary["run_dir"]) if row["step"] > stop]
    assert len(trained) == len(expected) == STEPS - stop > 0
    for step, (a, b) in enumerate(zip(expected, trained), start=stop + 1):
        assert b == pytest.approx(a, rel=REL_TOL), f"step {step}: {saved} {a}, {saved} then {resumed} {b}"
    assert_weights_close(runs[saved], summary)


@pytest.mark.parametrize("async_save", [False, True])
def test_a_killed_fsdp_worker_resumes_to_the_same_weights(runs, tmp_path, monkeypatch, async_save):
    """Saves every 4 steps, a kill at step 18: resumed from step 16's checkpoint, or with async
    saves (their staging buffers reused since step 4) from 12's or 16's, whichever had committed."""
    monkeypatch.setenv(FAULT_ENV, "sigkill:rank=1:step=18")
    summary = scaletrain.run(JOB, tiny_gpt(tmp_path, "fsdp", 2, "recovery.max_restarts=1", "checkpoint.every_steps=4",
                                           f"checkpoint.async_save={str(async_save).lower()}"))
    assert summary["restarts"] == 1 and summary["resumed_from_step"] in ((12, 16) if async_save else (16,))
    assert summary["weights_sha256"] == runs["fsdp"]["weights_sha256"]
    assert [row["step"] for row in read_metrics(summary["run_dir"])] == list(range(1, STEPS + 1))


@pytest.mark.parametrize("strategy", ["single", "ddp", "zero1", "fsdp", "hsdp", "fsdp_offload", "fsdp_bf16", "hsdp_2x2"])
def test_the_planner_predicts_each_ranks_state_bytes_exactly(runs, strategy):
    """Offloaded or computing in bf16, a rank keeps the same fp32 shards (on the host when
    offloaded): the same bytes."""
    import sys

    from scaletrain.plan.estimate import state_bytes_per_rank
    from scaletrain.plan.model_profile import profile_task

    sys.path.insert(0, str(REPO / "examples"))
    from tiny_gpt import TinyGPTTask

    profile = profile_task(TinyGPTTask(layers=2, dim=64, heads=4, context=32, vocab=32), "tiny_gpt")
    measured = state_bytes_by_rank(runs[strategy]["run_dir"])
    shard = {"single": 1, "ddp": 1, "zero1": 1, "hsdp": 1}.get(strategy, 2)  # hsdp: 2 replicas of 1; hsdp_2x2: of 2
    zero = 2 if strategy == "zero1" else 1  # whole parameters' optimizer state per rank
    assert sorted(measured) == list(range(runs[strategy]["world_size"]))
    for rank, sizes in measured.items():
        predicted = state_bytes_per_rank(profile, shard, rank % shard if zero == 1 else rank, "adamw", 0.0, zero)
        assert {k: sizes[k] for k in predicted} == predicted, f"rank {rank}"
        assert sizes["buffers"] == profile.buffer_bytes
