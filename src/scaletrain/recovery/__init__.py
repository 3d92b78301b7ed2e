"""Recovery: what lets a run survive, and explains, a failure.

``signals`` (the stop request: SIGTERM/SIGUSR1), ``watchdog`` (the hang watchdog),
``attempts`` (which start this is, a failed rank's error file), ``root_cause`` (the launcher's
one line for a failed attempt), ``resume`` (which run and checkpoint ``scaletrain resume``
continues), ``faults`` (fault injection for tests). The training loop (engine/) imports none of
it: the worker hands it a stop source, a watchdog and an after-step hook.
"""
