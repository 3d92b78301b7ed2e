"""A stand-in worker for the warm workers' tests (launch/warm_workers.py): records what it sees
as it starts, then does what its second argument says."""

import json
import os
import signal
import sys
import time
from pathlib import Path


def main() -> None:
    out, action = Path(sys.argv[1]), sys.argv[2]
    out.write_text(json.dumps({
        "name": __name__, "argv": sys.argv, "pid": os.getpid(), "ppid": os.getppid(), "pgid": os.getpgid(0),
        "env": os.environ.get("WARM_TEST"), "cwd": os.getcwd(), "torch_preloaded": "torch" in sys.modules,
    }))
    print("hello from the worker", flush=True)
    if action == "exit3":
        sys.exit(3)
    if action == "stop-on-sigterm":
        signal.signal(signal.SIGTERM, lambda *_: (out.with_suffix(".stopped").write_text("SIGTERM"), sys.exit(0)))
    time.sleep(120)


if __name__ == "__main__":
    main()
