"""How the local engine's launchers find each other: torch elastic's c10d dynamic rendezvous,
over a store we bind ourselves.

- One machine: the store listens on 127.0.0.1 alone (TCPStore would listen on every interface,
  and torch elastic unpickles what it reads there).
- Several machines (``scale.nodes``): the driver, node 0, hosts the store on the endpoint the
  user names (``--rdzv-endpoint HOST:PORT``); every other node connects to it. The driver
  publishes the run (id, trace id, configuration hash) there before its workers start, so a
  joining node takes the same run id, or refuses a job that differs.
- The driver's workers take the first global ranks whatever order torch's rendezvous puts the
  nodes in (it sorts them by address and pid): rank 0 writes the metrics, the final weights and
  the result into the driver's run directory, and no node needs another's disk.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from typing import Any

from scaletrain.distributed.stores import (
    connect_store,
    host_store,
    interface_of,
    route_source,
    wait_listening,
)
from scaletrain.errors import ConfigError, ScaletrainError
from scaletrain.rundir import DRIVER_STORE_ENV, NODE_RANK_ENV

__all__ = ["Rendezvous", "BACKEND", "NODE_RANK_ENV", "parse_endpoint", "for_job", "report_failure"]

BACKEND = "scaletrain"
_RUN_KEY = "scaletrain/run"
_FAILED_KEY = "scaletrain/failed/"  # + rank: a failed rank's error, exit and last log lines
_prepared: dict[str, Rendezvous] = {}  # run id -> the rendezvous its launcher prepared


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    try:
        number = int(port)
    except ValueError:
        number = -1
    if not host or not 0 < number < 65536:
        raise ConfigError(f"scale.rdzv_endpoint: expected HOST:PORT, got {endpoint!r}")
    return host.strip("[]"), number


def for_job(job: Any, run_id: str, node_rank: int) -> Rendezvous:
    """The rendezvous of a job on several nodes (scale.nodes, scale.rdzv_endpoint)."""
    low, high = job.scale.node_range
    host, port = parse_endpoint(job.scale.rdzv_endpoint)
    if not 0 <= node_rank < high:
        raise ConfigError(f"--node-rank {node_rank}: this job runs on {high} nodes, ranks 0 to {high - 1}")
    return Rendezvous(run_id, low, high, node_rank, host, port, job.recovery.node_wait_s)


@dataclass
class Rendezvous:
    """One launcher's side of the rendezvous."""

    run_id: str
    min_nodes: int
    max_nodes: int
    node_rank: int
    host: str  # where the store listens (the driver's address for several nodes)
    port: int
    timeout_s: float  # joining, and a missing node's wait, in seconds
    store: Any = None
    local_addr: str = "127.0.0.1"

    @classmethod
    def single_node(cls, run_id: str, timeout_s: float = 120) -> Rendezvous:
        return cls(run_id, 1, 1, 0, "127.0.0.1", 0, timeout_s)

    @property
    def is_driver(self) -> bool:
        return self.node_rank == 0

    @property
    def endpoint(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def open(self) -> Rendezvous:
        """Host the store (driver) or connect to it (other nodes)."""
        try:
            if self.is_driver:
                self.store = host_store(self.host, self.port, self.timeout_s, multi_tenant=True)
                self.port = self.store.port
                self.local_addr = self.host
            else:
                # Asked in Python first: torch's store client prints a C++ trace per retry.
                if not wait_listening(self.host, self.port, self.timeout_s):
                    raise ScaletrainError(
                        f"nothing answered at {self.endpoint} (the driver, node 0) within "
                        f"{self.timeout_s:g} s; start node 0 first with the same job, and check "
                        "scale.rdzv_endpoint (recovery.node_wait_s sets the wait)"
                    )
                self.store = connect_store(self.host, self.port, self.timeout_s)
                self.local_addr = route_source(self.host, self.port)
        except (OSError, RuntimeError) as exc:
            what = "listen on" if self.is_driver else "reach the driver (node 0) at"
            raise ScaletrainError(
                f"cannot {what} {self.endpoint}: {str(exc).splitlines()[0][:200]}; check "
                "scale.rdzv_endpoint (the driver's address and a free port)"
                + ("" if self.is_driver else ", and that node 0 was started")
            ) from None
        return self

    def publish_run(self, info: dict[str, Any]) -> None:
        """Driver: what a joining node must agree with."""
        self.store.set(_RUN_KEY, json.dumps(info))

    def read_run(self) -> dict[str, Any]:
        """Another node: the driver's run (waits for it, up to the timeout)."""
        try:
            return json.loads(self.store.get(_RUN_KEY))
        except (RuntimeError, ValueError) as exc:
            raise ScaletrainError(
                f"the driver at {self.endpoint} published no run within {self.timeout_s:g} s "
                f"({exc}); start node 0 with the same job"
            ) from None

    def worker_env(self) -> dict[str, str]:
        """For this node's workers: collectives on the interface this node was reached on."""
        env = {NODE_RANK_ENV: str(self.node_rank)}
        if self.max_nodes > 1:  # a failed worker tells the driver why (report_failure)
            env[DRIVER_STORE_ENV] = self.endpoint
        interface = interface_of(self.local_addr)
        if interface is not None:
            env.setdefault("GLOO_SOCKET_IFNAME", interface)
            env.setdefault("NCCL_SOCKET_IFNAME", interface)
        return {k: os.environ.get(k, v) for k, v in env.items()}

    def launch_options(self) -> dict[str, Any]:
        """What torch elastic's LaunchConfig takes for this rendezvous (the handler it creates
        from them uses this object's store)."""
        _prepared[self.run_id] = self
        timeout = max(1, int(self.timeout_s))
        # A node silent for about the node wait is dead (torch: 5 s x 3 heartbeats missed).
        interval = max(1, min(5, timeout // 3))
        return dict(
            min_nodes=self.min_nodes,
            max_nodes=self.max_nodes,
            rdzv_backend=BACKEND,
            rdzv_endpoint=self.endpoint,
            run_id=self.run_id,
            local_addr=self.local_addr,
            rdzv_configs={
                "join_timeout": max(timeout, 120),
                # An elastic job waits this long for missing nodes before going on without them.
                "last_call_timeout": timeout if self.min_nodes < self.max_nodes else 1,
                "close_timeout": 30,
                "keep_alive_interval": interval,
                "keep_alive_max_attempt": max(3, -(-timeout // interval)),
            },
        )

    def publish_failures(self, failures: dict[int, dict[str, Any]]) -> None:
        """Another node: how its workers failed (exit codes the agent saw), for the driver
        (best effort: the driver may have ended already)."""
        try:
            for rank, record in failures.items():
                key = f"{_FAILED_KEY}{rank}"
                if not self.store.check([key]):  # the worker's own report says more
                    self.store.set(key, json.dumps(record))
        except Exception:  # noqa: S110  best effort: the store may be gone with the driver
            pass

    def read_failures(self, ranks: list[int], attempt: int, wait_s: float = 5.0) -> dict[int, dict[str, Any]]:
        """Driver: what failed ranks on other nodes reported in attempt ``attempt`` (waits a
        little for late reports; earlier attempts' were recovered from)."""
        import time

        deadline = time.monotonic() + wait_s
        found: dict[int, dict[str, Any]] = {}
        while True:
            for rank in ranks:
                key = f"{_FAILED_KEY}{rank}"
                if rank not in found and self.store.check([key]):
                    try:
                        record = json.loads(self.store.get(key))
                    except (RuntimeError, ValueError):
                        continue
                    if record.get("attempt") == attempt:
                        found[rank] = record
            if found or time.monotonic() >= deadline:
                return found
            time.sleep(0.2)

    def check_joined(self, run_id: str | None, config_hash: str) -> dict[str, Any]:
        """Another node: the driver's run, which this node's job must match."""
        info = self.read_run()
        if info.get("config_hash") != config_hash:
            raise ConfigError(
                f"node {self.node_rank}'s job differs from the driver's (configuration hash "
                f"{config_hash}, the driver's {info.get('config_hash')}): start every node with "
                "the same job file and --set options"
            )
        if run_id is not None and info.get("run_id") != run_id:
            raise ConfigError(
                f"node {self.node_rank} resumes run {run_id} but the driver runs "
                f"{info.get('run_id')}: resume the same run on every node"
            )
        return info

    def close(self) -> None:
        _prepared.pop(self.run_id, None)
        self.store = None


def report_failure(rank: int, record: dict[str, Any]) -> None:
    """A failed worker on a job of several nodes: its error and last log lines, to the driver's
    store (best effort: the driver's run directory then names the real cause)."""
    endpoint = os.environ.get(DRIVER_STORE_ENV)
    if not endpoint:
        return
    try:
        host, port = parse_endpoint(endpoint)
        connect_store(host, port, timeout_s=5).set(f"{_FAILED_KEY}{rank}", json.dumps(record))
    except Exception:  # noqa: S110  the driver may be gone too
        pass


def caller_name(depth: int = 2) -> str:
    """What torch's ``dynamic_rendezvous.get_method_name`` returns (the name of the function
    ``depth`` frames up from this one), without its two ``inspect.stack()`` calls: each builds
    every frame's source context, 80 ms at the launcher's stack depth here (35 ms at
    torchrun's), and the rendezvous logs through it about ten times before the workers start."""
    try:
        return sys._getframe(depth).f_code.co_name
    except ValueError:  # a shallower stack
        return "no_method_name"


def _create_handler(params: Any) -> Any:
    """torch elastic asks the registry for a handler: ours, over the prepared store."""
    from datetime import timedelta

    from torch.distributed.elastic.rendezvous import dynamic_rendezvous
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousTimeout

    if hasattr(dynamic_rendezvous, "get_method_name"):  # only a log record's name changes hands
        dynamic_rendezvous.get_method_name = caller_name

    prepared = _prepared.get(params.run_id)
    if prepared is None:
        raise RuntimeError(f"no prepared rendezvous for run {params.run_id}")
    seconds = {key: timedelta(seconds=value) for key, value in params.config.items()
               if key.endswith("_timeout")}
    handler = _driver_first_class().from_backend(
        params.run_id, prepared.store, C10dRendezvousBackend(prepared.store, params.run_id),
        params.min_nodes, params.max_nodes, local_addr=params.local_addr,
        timeout=RendezvousTimeout(join=seconds.get("join_timeout"),
                                  last_call=seconds.get("last_call_timeout"),
                                  close=seconds.get("close_timeout")),
        keep_alive_interval=int(params.config.get("keep_alive_interval", 5)),
        keep_alive_max_attempt=int(params.config.get("keep_alive_max_attempt", 3)),
    )
    handler.scaletrain_is_driver = prepared.is_driver
    return handler


_DRIVER_FIRST = None


def _driver_first_class():
    global _DRIVER_FIRST
    if _DRIVER_FIRST is None:
        from torch.distributed import PrefixStore
        from torch.distributed.elastic.rendezvous.api import RendezvousInfo, RendezvousStoreInfo
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

        class DriverFirstHandler(DynamicRendezvousHandler):
            """The driver's node becomes group rank 0 (its first worker global rank 0)."""

            scaletrain_is_driver = False

            def get_backend(self) -> str:
                return BACKEND

            def next_rendezvous(self) -> RendezvousInfo:
                info = super().next_rendezvous()
                store = PrefixStore("scaletrain/order/", info.store)
                store.set(str(info.rank), b"1" if self.scaletrain_is_driver else b"0")  # type: ignore[arg-type]  # Store.set takes bytes too
                drivers = [store.get(str(r)) == b"1" for r in range(info.world_size)]
                order = sorted(range(info.world_size), key=lambda r: (not drivers[r], r))
                rank = order.index(info.rank)
                bootstrap = RendezvousStoreInfo.build(
                    rank, PrefixStore("scaletrain/bootstrap/", info.store), self._this_node.addr
                )
                return RendezvousInfo(info.store, rank, info.world_size, bootstrap)

        _DRIVER_FIRST = DriverFirstHandler
    return _DRIVER_FIRST


def register() -> None:
    """Make the backend known to torch elastic (once per process)."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry as registry

    registry.register(BACKEND, _create_handler)
