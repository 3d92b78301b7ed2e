"""The standard env contract (what torchrun and Ray Train both set), read in one place."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["DistEnv"]


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the job. Defaults describe a lone in-process worker."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> DistEnv:
        env = os.environ if environ is None else environ
        world_size = int(env.get("WORLD_SIZE", "1"))
        return cls(
            rank=int(env.get("RANK", "0")),
            world_size=world_size,
            local_rank=int(env.get("LOCAL_RANK", "0")),
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", str(world_size))),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env["MASTER_PORT"]) if env.get("MASTER_PORT") else None,
        )

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0
