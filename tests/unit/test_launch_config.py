"""The local launcher's LaunchConfig on the torch it finds: a field an older torch lacks is
left out (or stands in the environment), never a TypeError before any worker starts (seen on
a torch 2.11 GPU machine: ``unexpected keyword argument 'shutdown_timeout'``)."""

from __future__ import annotations

import dataclasses

from torch.distributed.launcher.api import LaunchConfig

from scaletrain.launch.local import launch_config

OPTIONS = dict(min_nodes=1, max_nodes=1, nproc_per_node=2, max_restarts=3,
               signals_to_handle="SIGINT,SIGHUP,SIGQUIT", shutdown_timeout=45)


def _older(*missing: str) -> type:
    """LaunchConfig as a torch without ``missing`` declares it."""
    kept = [(f.name, f.type, f) for f in dataclasses.fields(LaunchConfig) if f.name not in missing]
    return dataclasses.make_dataclass("LaunchConfig", kept)


def test_this_torch_takes_every_option():
    config, env = launch_config(LaunchConfig, **OPTIONS)
    assert (config.shutdown_timeout, config.signals_to_handle, config.nproc_per_node) == (45, "SIGINT,SIGHUP,SIGQUIT", 2)
    assert env == {}


def test_torch_2_11_without_shutdown_timeout():
    config, env = launch_config(_older("shutdown_timeout"), **OPTIONS)
    assert not hasattr(config, "shutdown_timeout")
    assert (config.signals_to_handle, config.max_restarts) == ("SIGINT,SIGHUP,SIGQUIT", 3)
    assert env == {}


def test_torch_without_signals_to_handle_reads_them_from_the_environment():
    config, env = launch_config(_older("shutdown_timeout", "signals_to_handle"), **OPTIONS)
    assert not hasattr(config, "signals_to_handle")
    assert env == {"TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGINT,SIGHUP,SIGQUIT"}


def test_the_workers_of_each_start_learn_which_start_it_is(tmp_path):
    """From the launcher, not torch elastic's count (which misses a restart another node caused):
    every start of the workers, failure here or membership change, counts."""
    from scaletrain.launch.local import _attempt_logs
    from scaletrain.rundir import RESTART_COUNT_ENV, RunSpec

    logs = _attempt_logs(RunSpec(job={"name": "toy"}, run_id="r", run_dir=str(tmp_path)))
    seen = []
    for _ in range(3):
        envs = {0: {"TORCHELASTIC_RESTART_COUNT": "0"}, 1: {"TORCHELASTIC_RESTART_COUNT": "0"}}
        logs.reify(envs)
        seen.append([env[RESTART_COUNT_ENV] for env in envs.values()])
    assert seen == [["0", "0"], ["1", "1"], ["2", "2"]]


def test_launchers_are_a_registry_of_engines(tmp_path):
    import importlib

    from scaletrain.config import parse_job
    from scaletrain.launch import LAUNCHERS, Launcher, launcher_for, launcher_name
    from scaletrain.launch.local import LocalLauncher
    from tests.helpers.tasks import toy_job

    for name, target in LAUNCHERS.items():
        module, _, cls = target.partition(":")
        launcher = getattr(importlib.import_module(module), cls)
        assert issubclass(launcher, Launcher) and launcher.name == name
    one = parse_job(toy_job(tmp_path))
    assert launcher_name(one) == "in-process"
    assert launcher_name(parse_job(toy_job(tmp_path, recovery={"max_restarts": 1}))) == "local"
    assert launcher_name(one, rendezvous=object()) == "local"  # one node of several
    assert launcher_name(parse_job(toy_job(tmp_path, scale={"workers": 1, "engine": "ray"}))) == "ray"
    local = launcher_for(parse_job(toy_job(tmp_path, scale={"workers": 2},
                                           recovery={"max_restarts": 3, "grace_period_s": 9})))
    assert isinstance(local, LocalLauncher)
    assert (local.max_restarts, local.grace_period_s, local.job_workers) == (3, 9, 2)


def test_the_rendezvous_names_its_callers_as_torch_does_without_inspecting_the_stack():
    import inspect

    from scaletrain.launch.rendezvous import caller_name

    def torchs(depth=2):  # torch's dynamic_rendezvous.get_method_name, as written there
        if len(inspect.stack()) > depth:
            return inspect.stack()[depth].function
        return "no_method_name"

    def record():  # as DynamicRendezvousHandler._record calls it
        return torchs(), caller_name()

    def next_rendezvous():
        return record()

    assert next_rendezvous() == ("next_rendezvous", "next_rendezvous")
    assert caller_name(10_000) == torchs(10_000) == "no_method_name"
