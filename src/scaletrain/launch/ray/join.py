"""Joining a Ray cluster: within ``scale.connect_timeout_s``, something answers where Ray will
connect, it is a Ray head, and it lets this process in, with the token Ray's CLI would use when
the head asks for one; else one line says what to do.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from scaletrain.errors import ConfigError

__all__ = ["check_cluster_answers", "native_stderr_to", "LOCAL_ONLY_ENV", "CONNECT_TIMEOUT_S"]

# Ray's switch for clusters on macOS/Windows; "0" keeps a local instance on 127.0.0.1.
LOCAL_ONLY_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
# Joining a cluster: how long the address may take to answer (scale.connect_timeout_s).
CONNECT_TIMEOUT_S = 60.0

# Joining a cluster. Ray's own connect (ray.init(address=...)) asks the head up to 20 times,
# each try up to ~40 s when nothing answers (ray/_private/node.py, Node._init_gcs_client;
# RAY_NUM_REDIS_GET_RETRIES), printing its C++ client's warnings on stderr all along: over ten
# minutes before a one-line "Failed to connect". So scaletrain asks first, within the job's
# scale.connect_timeout_s, and says what is wrong in one line.
#
# Tokens: `ray start --head` turns token authentication on when a token exists (RAY_AUTH_TOKEN,
# RAY_AUTH_TOKEN_PATH, else ~/.ray/auth_token; ray/scripts/scripts.py calls
# maybe_enable_token_auth_if_token_available), and so does ray.init() for a cluster it finds on
# its own (address None/"auto"); with an explicit address Ray never does (ray/_private/worker.py,
# "an explicit address ... never does"), and the join fails on an unauthenticated reply. We send
# a token only to a cluster that asks for one, as Ray would for a cluster on this machine: a
# token the user set (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH) to any cluster; the default file,
# which belongs to this machine's clusters, only to a cluster on this machine. RAY_AUTH_MODE,
# when set, is the user's choice and stands.

_TOKEN_FILE = "~/.ray/auth_token"  # noqa: S105  a file name / hint text, not a secret
_TOKEN_HINT = "`ray get-auth-token` on the head prints it"  # noqa: S105  a file name / hint text, not a secret


def check_cluster_answers(address: str, timeout_s: float) -> str | None:
    """Within ``timeout_s``: something listens where Ray will connect, and it is a Ray head
    that lets this process in. Returns where the token this process sends comes from (None:
    no token); raises ConfigError (one line) when the cluster cannot be joined."""
    if "://" in address:  # Ray Client (ray://): Ray's own connection and its own errors
        return _token_in_use()
    from ray._private import services

    try:
        target = services.canonicalize_bootstrap_address(address)
        host, port = services.parse_address(target) if target else (None, "0")
        if not port.isdigit():
            raise ValueError(f"Invalid address format: {address}")
        port = int(port)
    except Exception as exc:
        raise ConfigError(
            f"cannot join the Ray cluster at {address!r}: {str(exc)[:200]}; give HOST:PORT of "
            "the head (its `ray start --head --port`, default 6379), e.g. 10.0.0.5:6379"
        ) from None
    if target is None:  # "auto" and no cluster found: ray.init says so
        return _token_in_use()
    deadline = time.monotonic() + timeout_s
    given_host = address.rpartition(":")[0].strip("[]")
    dialled = target if given_host == host else (
        f"{target} (Ray dials {given_host} as this machine's address)"
    )
    while not _listening(host, port, max(0.1, min(2.0, deadline - time.monotonic()))):  # type: ignore[arg-type]  # host is set once target is
        mapped = _is_loopback(given_host) and not _is_loopback(host)  # type: ignore[arg-type]  # host is set once target is
        if mapped and _listening("127.0.0.1", port, 1.0):
            raise ConfigError(
                f"cannot join the Ray cluster at {address!r}: its head listens on 127.0.0.1 only "
                f"(Ray's local-only mode, {LOCAL_ONLY_ENV}=0 when it started) while Ray dials "
                f"{given_host} as this machine's address {host}; run scaletrain with "
                f"{LOCAL_ONLY_ENV}=0 as well, or restart the head without it"
            )
        if time.monotonic() + 0.5 >= deadline:
            raise ConfigError(
                f"cannot join the Ray cluster at {address!r}: nothing answered at {dialled} "
                f"within {timeout_s:g} s; is `ray start --head --port {port}` running there, and "
                f"reachable from here? (a head started with {LOCAL_ONLY_ENV}=0 answers on its own "
                "127.0.0.1 only; scale.connect_timeout_s sets the wait)"
            )
        time.sleep(0.5)
    if not _speaks_grpc(host, port, max(0.5, deadline - time.monotonic())):  # type: ignore[arg-type]  # host is set once target is
        raise ConfigError(
            f"cannot join the Ray cluster at {address!r}: {target} answers, but not as a Ray head "
            "(no gRPC reply); is it the head's port (`ray start --head --port`, default 6379)? "
            "(scale.connect_timeout_s sets the wait)"
        )
    return _check_head(address, target, deadline, timeout_s)


def _check_head(address: str, target: str, deadline: float, timeout_s: float) -> str | None:
    """Ask the head what Ray's connect asks first (its cluster id; the token is checked here);
    on an unauthenticated reply, once more with the token Ray would use (see above)."""
    token_from = _token_in_use()
    if token_from is None and (os.environ.get("RAY_AUTH_MODE") or "").lower() == "token":
        # Ray's client would abort the process (authentication_token_loader.cc: check failed)
        raise ConfigError(
            f"cannot join the Ray cluster at {address!r}: RAY_AUTH_MODE=token, and no token is "
            f"set; set RAY_AUTH_TOKEN to the cluster's token ({_TOKEN_HINT})"
        )
    error = _ask_head(target, deadline)
    if _unauthenticated(error) and os.environ.get("RAY_AUTH_MODE") is None:
        offered = _token_source()
        if offered is not None and (offered != _TOKEN_FILE or _on_this_machine(target)):
            _enable_token_auth()
            token_from = offered
            error = _ask_head(target, deadline)
    if error is None:
        return token_from
    if isinstance(error, TimeoutError):
        raise ConfigError(
            f"cannot join the Ray cluster at {address!r}: {target} answers, but no Ray head "
            f"replied within {timeout_s:g} s; is it the head's port (`ray start --head --port`, "
            "default 6379), and has the head finished starting? (scale.connect_timeout_s sets "
            "the wait)"
        )
    if _unauthenticated(error):
        raise ConfigError(f"cannot join the Ray cluster at {address!r}: {_token_fix(token_from)}")
    first = (str(error).strip().splitlines() or [""])[0][:200]
    first = first if first.rstrip(":") not in ("", "RPC error") else type(error).__name__
    raise ConfigError(
        f"cannot join the Ray cluster at {address!r}: {target} answers, but not as a Ray head "
        f"({first}); is it the head's port (`ray start --head --port`, default 6379)?"
    )


def _ask_head(target: str, deadline: float) -> BaseException | None:
    """None when the head at ``target`` replied; its error; or TimeoutError by ``deadline``
    (the client's own waits are longer: it runs in a thread that is left to finish)."""
    try:
        from ray._raylet import GcsClient  # type: ignore[attr-defined]  # Ray's private API, guarded by ImportError
    except ImportError:
        return None
    outcome: dict[str, BaseException | None] = {}

    def ask() -> None:
        try:
            GcsClient(address=target)  # `ray status` starts the same way
            outcome["error"] = None
        except Exception as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=ask, name="scaletrain-ray-join", daemon=True)
    thread.start()
    thread.join(max(2.0, deadline - time.monotonic()))
    return outcome["error"] if "error" in outcome else TimeoutError()


def _unauthenticated(error: BaseException | None) -> bool:
    text = str(error or "")
    return error is not None and (
        type(error).__name__ == "AuthenticationError"
        or "Unauthenticated" in text
        or "InvalidAuthToken" in text
    )


def _token_fix(token_from: str | None) -> str:
    """The one thing to do when the cluster refused this process."""
    mode = os.environ.get("RAY_AUTH_MODE")
    if token_from is not None:
        return (
            f"the cluster refused the token from {token_from}; set RAY_AUTH_TOKEN to the "
            f"cluster's token ({_TOKEN_HINT})"
        )
    if mode is not None and mode.lower() != "token":
        return (
            f"the cluster requires Ray's token authentication, which RAY_AUTH_MODE={mode} turns "
            f"off here; set RAY_AUTH_MODE=token (Ray then sends RAY_AUTH_TOKEN, else "
            f"RAY_AUTH_TOKEN_PATH, else {_TOKEN_FILE}: the cluster's token, {_TOKEN_HINT})"
        )
    if _token_source() == _TOKEN_FILE:
        return (
            f"the cluster requires a token, and {_TOKEN_FILE} (the token of this machine's "
            "clusters) is sent only to a cluster on this machine; set RAY_AUTH_TOKEN to the "
            f"cluster's token ({_TOKEN_HINT}), or RAY_AUTH_MODE=token to send {_TOKEN_FILE}"
        )
    return (
        f"the cluster requires a token and none is set; set RAY_AUTH_TOKEN to the cluster's "
        f"token ({_TOKEN_HINT})"
    )


def _token_source() -> str | None:
    """Where Ray would read a token from, in Ray's order; None when there is none. A
    RAY_AUTH_TOKEN_PATH that cannot be read is bad input (Ray would abort the process)."""
    if os.environ.get("RAY_AUTH_TOKEN", "").strip():
        return "RAY_AUTH_TOKEN"
    path = os.environ.get("RAY_AUTH_TOKEN_PATH")
    if path:
        try:
            if Path(path).expanduser().read_text().strip():
                return f"RAY_AUTH_TOKEN_PATH ({path})"
        except OSError:
            pass
        raise ConfigError(
            f"RAY_AUTH_TOKEN_PATH names {path}, which cannot be read or is empty; point it at the "
            f"file with the cluster's token ({_TOKEN_HINT}), or unset it"
        )
    try:
        if (Path.home() / ".ray" / "auth_token").read_text().strip():
            return _TOKEN_FILE
    except OSError:
        pass
    return None


def _token_in_use() -> str | None:
    if (os.environ.get("RAY_AUTH_MODE") or "").lower() != "token":
        return None
    return _token_source()


def _enable_token_auth() -> None:
    """RAY_AUTH_MODE=token for this process, as Ray's own CLI sets it (ray/_private/
    authentication/authentication_token_setup.py, _enable_token_auth): the environment, then
    Ray's cached settings and token."""
    os.environ["RAY_AUTH_MODE"] = "token"
    try:
        from ray._raylet import AuthenticationTokenLoader, Config  # type: ignore[attr-defined]  # Ray's private API, guarded by ImportError

        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()
    except (ImportError, AttributeError):
        pass


# HTTP/2's client greeting and an empty SETTINGS frame: a gRPC server (Ray's GCS) answers with
# its own SETTINGS frame before any call, token or not.
_HTTP2_GREETING = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])


def _speaks_grpc(host: str, port: int, timeout_s: float) -> bool:
    """The listener answers as a gRPC server does, within ``timeout_s``: checked in Python, so
    that Ray's C++ client (whose waits are its own, and loud) only meets a gRPC server."""
    if os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true"):
        return True  # a TLS handshake first; Ray's client does it
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as conn:
            conn.settimeout(timeout_s)
            conn.sendall(_HTTP2_GREETING)
            frame = b""
            while len(frame) < 9:
                chunk = conn.recv(9 - len(frame))
                if not chunk:
                    return False
                frame += chunk
    except OSError:
        return False
    return frame[3] == 4  # the frame type: SETTINGS


def _listening(host: str, port: int, timeout_s: float) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def _is_loopback(host: str) -> bool:
    return host == "localhost" or host == "::1" or host.startswith("127.")


def _on_this_machine(target: str) -> bool:
    """``target``'s host is an address of this machine (one a socket here can bind)."""
    host = target.rpartition(":")[0].strip("[]")
    if _is_loopback(host):
        return True
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_UDP)
    except OSError:
        return False
    for family, _, _, _, sockaddr in infos:
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as probe:
                probe.bind((sockaddr[0], 0))
            return True
        except OSError:
            continue
    return False


@contextlib.contextmanager
def native_stderr_to(path: Path) -> Iterator[None]:
    """File descriptor 2 (what C++ code writes to) goes to ``path`` for the block."""
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(path, "ab") as target:
            os.dup2(target.fileno(), 2)
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
