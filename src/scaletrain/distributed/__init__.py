"""Where a process sits in the job, which device and backend it uses, and the process group."""

from scaletrain.distributed.env import DistEnv

__all__ = ["DistEnv"]
