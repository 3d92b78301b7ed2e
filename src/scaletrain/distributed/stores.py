"""TCP key-value stores that listen only where we say.

``TCPStore(host, port, is_master=True)`` listens on every interface whatever ``host`` is, and
torch elastic unpickles the rendezvous state it reads from its store: whoever reaches the port
can run code in the launcher. So we bind the listening socket ourselves (127.0.0.1 for a job on
one machine, the address the user names for several) and hand it to the store.
"""

from __future__ import annotations

import ipaddress
import socket
from datetime import timedelta

import torch.distributed as dist

__all__ = ["bound_listener", "host_store", "connect_store", "interface_of", "route_source", "wait_listening"]


def bound_listener(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` only (port 0: any free one)."""
    family, kind, proto, _, address = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(1024)
    except OSError:
        sock.close()
        raise
    return sock


def host_store(host: str, port: int, timeout_s: float, world_size: int | None = None,
               multi_tenant: bool = False) -> dist.TCPStore:
    """A store server listening on ``host:port`` alone (``port`` 0: a free one; ``.port`` says
    which)."""
    sock = bound_listener(host, port)
    bound_port = sock.getsockname()[1]
    return dist.TCPStore(
        host, bound_port, world_size, True, timedelta(seconds=timeout_s),
        wait_for_workers=False, multi_tenant=multi_tenant, master_listen_fd=sock.detach(),
    )


def connect_store(host: str, port: int, timeout_s: float, world_size: int | None = None) -> dist.TCPStore:
    """A client of the store on ``host:port``; retries until ``timeout_s``."""
    return dist.TCPStore(host, port, world_size, False, timedelta(seconds=timeout_s))


def wait_listening(host: str, port: int, timeout_s: float) -> bool:
    """True once something accepts connections on ``host:port``, False after ``timeout_s``."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=min(2.0, max(0.1, timeout_s))):
                return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.25)


def route_source(host: str, port: int = 9) -> str:
    """This machine's address on the route to ``host`` (no packet is sent)."""
    infos = socket.getaddrinfo(host, port, 0, socket.SOCK_DGRAM)
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(address)
        return probe.getsockname()[0]


def interface_of(address: str) -> str | None:
    """The name of the network interface that has ``address`` (for GLOO/NCCL_SOCKET_IFNAME)."""
    import psutil

    try:
        wanted = ipaddress.ip_address(address)
    except ValueError:
        return None
    for name, addresses in psutil.net_if_addrs().items():
        for item in addresses:
            try:
                if ipaddress.ip_address(item.address.split("%")[0]) == wanted:
                    return name
            except ValueError:
                continue
    return None
