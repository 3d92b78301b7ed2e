import os

import torch

from scaletrain.distributed.device import apply_threads, choose_placement, threads_per_worker
from scaletrain.distributed.env import DistEnv


def test_threads_split_the_cores_between_local_workers():
    cores = len(os.sched_getaffinity(0))
    assert threads_per_worker(1) == cores
    assert threads_per_worker(cores * 4) == 1
    assert threads_per_worker(2, requested=3) == 3


def test_apply_threads_sets_torch_and_the_env(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    try:
        apply_threads(1)
        assert torch.get_num_threads() == 1
        assert os.environ["OMP_NUM_THREADS"] == "1"
    finally:
        torch.set_num_threads(before)


def test_env_contract_and_cpu_placement():
    env = DistEnv.from_env({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_PORT": "29500"})
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (1, 2, 1, 2)
    assert env.is_distributed and not env.is_main and env.master_port == 29500
    assert DistEnv.from_env({}) == DistEnv()
    if not torch.cuda.is_available():
        placement = choose_placement(env)
        assert placement.device.type == "cpu" and placement.backend == "gloo"
