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
from dataclasses import dataclass
from typing import Any

from scaletrain.distributed.stores import connect_store, host_store, interface_of, route_source
from scaletrain.errors import ConfigError, ScaletrainError

__all__ = ["Rendezvous", "BACKEND", "parse_endpoint", "parse_nodes", "node_rank_env"]

BACKEND = "scaletrain"
NODE_RANK_ENV = "SCALETRAIN_NODE_RANK"  # the launcher's node rank, for its workers
_RUN_KEY = "scaletrain/run"
_prepared: dict[str, Rendezvous] = {}  # run id -> the rendezvous its launcher prepared


def node_rank_env() -> int:
    return int(os.environ.get(NODE_RANK_ENV, "0"))


def parse_nodes(value: int | str) -> tuple[int, int]:
    """``2`` -> (2, 2); ``"1:2"`` -> (1, 2)."""
    text = str(value)
    low, _, high = text.partition(":")
    try:
        least, most = int(low), int(high or low)
    except ValueError:
        raise ConfigError(f"scale.nodes: expected a count or MIN:MAX, got {text!r}") from None
    if not 1 <= least <= most:
        raise ConfigError(f"scale.nodes: expected 1 <= MIN <= MAX, got {text!r}")
    return least, most


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    try:
        number = int(port)
    except ValueError:
        number = -1
    if not host or not 0 < number < 65536:
        raise ConfigError(f"scale.rdzv_endpoint: expected HOST:PORT, got {endpoint!r}")
    return host.strip("[]"), number


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
                self.store = connect_store(self.host, self.port, self.timeout_s)
                self.local_addr = route_source(self.host, self.port)
        except (OSError, RuntimeError) as exc:
            what = "listen on" if self.is_driver else "reach the driver (node 0) at"
            raise ScaletrainError(
                f"cannot {what} {self.endpoint}: {str(exc).splitlines()[0][:200]}; check "
                "scale.rdzv_endpoint (the driver's address and a free port)"
                + ("" if self.is_driver else ", and that node 0 was started")
            ) from None
        _prepared[self.run_id] = self
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
        interface = interface_of(self.local_addr)
        if interface is not None:
            env.setdefault("GLOO_SOCKET_IFNAME", interface)
            env.setdefault("NCCL_SOCKET_IFNAME", interface)
        return {k: os.environ.get(k, v) for k, v in env.items()}

    def launch_options(self) -> dict[str, Any]:
        """What torch elastic's LaunchConfig takes for this rendezvous."""
        timeout = max(1, int(self.timeout_s))
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
            },
        )

    def close(self) -> None:
        _prepared.pop(self.run_id, None)
        self.store = None


def _create_handler(params: Any) -> Any:
    """torch elastic asks the registry for a handler: ours, over the prepared store."""
    from datetime import timedelta

    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousTimeout

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
                store.set(str(info.rank), b"1" if self.scaletrain_is_driver else b"0")
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
