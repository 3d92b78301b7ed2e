"""Workers on a Ray cluster, started by Ray Train's TorchTrainer (Train v2).

Ray Train places the workers (``ScalingConfig``), sets the env contract (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR/PORT), creates the process group and restarts the whole worker group
after a failure (``FailureConfig``); each worker runs the same ``run_worker`` as the local
engine, which resumes from the newest verified checkpoint. Ray is optional and imported here
only. A small actor (the mailbox) carries what Ray Train does not: the attempt number, rank
0's result, and a stop request from the launcher (Ctrl-C, SIGTERM).

Safe by default: a local instance starts no dashboard (the one HTTP service that runs code
for whoever reaches it) and uses token authentication where the installed Ray has it, so its
RPC ports (Ray listens on every interface and has no option to restrict that) answer only
holders of the token. Ray's logs stay out of the console (``logs/ray-driver.jsonl``, redacted);
a local session's own logs (workers' raw output) stay where Ray writes them, never in the run's
logs or MLflow: ``launcher.jsonl`` names the folder.

Joining a cluster (scale.address, RAY_ADDRESS) is checked first, within scale.connect_timeout_s:
something answers where Ray will connect, it is a Ray head, and it lets this process in, with
the token Ray's CLI would use when the head asks for one; else one line says what to do
(join.py).
"""

from scaletrain.launch.ray.cluster import import_ray, ray_session
from scaletrain.launch.ray.launcher import RayLauncher

__all__ = ["RayLauncher", "import_ray", "ray_session"]
