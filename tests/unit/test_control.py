"""Control: the stop, save and commit decisions every rank takes together, and when it asks."""

import pytest
import torch.distributed as dist

from scaletrain.distributed import collectives
from scaletrain.engine import control as control_module
from scaletrain.engine.control import Control, Decision
from tests.helpers.servers import free_port


class Clock:
    """Stands in for the time module in engine/control.py: time moves only when a test says."""

    def __init__(self):
        self.now = 1000.0

    def monotonic(self):
        return self.now


class Stop:
    def __init__(self):
        self.signal_name = None


class Watchdog:
    def __init__(self):
        self.pets = self.arms = 0

    def pet(self):
        self.pets += 1

    def arm(self):
        self.arms += 1


@pytest.fixture
def clock(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(control_module, "time", clock)
    return clock


@pytest.fixture
def reductions(monkeypatch):
    """Every all-reduce Control issues, still run for real."""
    calls = []
    real = collectives.all_reduce

    def counted(tensor, op="sum", group=None):
        calls.append(op)
        return real(tensor, op, group)

    monkeypatch.setattr(collectives, "all_reduce", counted)
    return calls


@pytest.fixture
def gloo_group():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


# One process, no group: every check decides from this rank's own view.

def test_nothing_to_do_is_the_empty_decision(clock):
    control = Control(False, Stop(), Watchdog(), save_every_s=None)
    clock.now += 1 / 64
    assert control.check(1, False, False) == Decision(report=True)  # a check step: report now
    decision = control.check(2, async_ready=False, async_pending=False)
    assert decision == Decision()
    assert not (decision.stop or decision.save or decision.commit or decision.report)


def test_no_stop_source_and_no_watchdog_are_allowed(clock):
    assert Control(False, None, None, save_every_s=None).check(1, False, False) == Decision(report=True)


def test_a_stop_signal_is_the_stop_decision(clock):
    stop = Stop()
    control = Control(False, stop, None, save_every_s=None)
    assert control.check(1, False, False).stop is None
    stop.signal_name = "SIGTERM"
    assert control.check(2, False, False).stop == "SIGTERM"
    stop.signal_name = "SIGUSR1"
    assert control.check(3, False, False).stop == "SIGUSR1"


def test_a_save_is_due_once_the_interval_elapsed_and_saved_resets_it(clock):
    control = Control(False, Stop(), None, save_every_s=60.0)
    clock.now += 59.9
    assert not control.check(1, False, False).save
    clock.now += 0.1
    assert control.check(2, False, False).save
    assert control.check(3, False, False).save, "still due until saved"
    control.saved()
    assert not control.check(4, False, False).save
    clock.now += 60.0
    assert control.check(5, False, False).save


def test_without_save_every_s_no_time_based_save(clock):
    control = Control(False, Stop(), None, save_every_s=None)
    clock.now += 10**6
    assert not control.check(1, False, False).save


@pytest.mark.parametrize(
    "ready, pending, commit",
    [(False, False, False), (True, False, False), (False, True, False), (True, True, True)],
)
def test_commit_only_when_an_async_save_is_pending_and_ready(clock, ready, pending, commit):
    decision = Control(False, Stop(), None, save_every_s=None).check(1, async_ready=ready, async_pending=pending)
    assert decision.commit is commit


def test_every_check_pets_the_watchdog_and_never_arms_it(clock):
    watchdog = Watchdog()
    control = Control(False, Stop(), watchdog, save_every_s=None)
    for step in range(1, 6):
        control.check(step, False, False)
    assert (watchdog.pets, watchdog.arms) == (5, 0)


def test_one_rank_reports_about_every_interval_at_its_own_pace(clock, reductions):
    """Alone, a rank reports (``report``) at check steps about interval_s apart, from its
    own steps' time: the first step after ``start``, then every 16 steps of 1/64 s, no
    collective; stop and save are still decided at every step."""
    control = Control(False, Stop(), None, save_every_s=None, interval_s=0.25)
    control.start(100)
    clock.now += 1 / 64
    assert control.check(101, False, False) == Decision(report=True)
    reported = []
    for step in range(102, 150):
        clock.now += 1 / 64
        if control.check(step, False, False).report:
            reported.append(step)
    assert reported == [117, 133, 149] and reductions == []


def test_without_a_group_no_collective_is_issued(clock, reductions):
    control = Control(False, Stop(), None, save_every_s=None)
    for step in range(1, 4):
        control.check(step, False, False)
    assert reductions == []


# A real (one-rank, gloo) process group: the decision goes through the all-reduce.

def test_the_first_check_is_at_step_1_and_the_agreed_interval_skips_the_steps_between(
        clock, reductions, gloo_group):
    watchdog = Watchdog()
    control = Control(True, Stop(), watchdog, save_every_s=None, interval_s=0.25)
    assert control._next_check == 1
    clock.now += 1 / 64  # one step took 1/64 s: 16 steps make the 0.25 s interval
    assert control.check(1, False, False) == Decision(report=True)
    assert reductions == ["max"] and watchdog.arms == 1
    assert control._next_check == 17
    for step in range(2, 17):
        assert control.check(step, False, False) == Decision()
    assert reductions == ["max"], "no collective between checks"
    assert watchdog.arms == 1 and watchdog.pets == 0
    clock.now += 1.0  # steps got slower: 1/16 s each over the 16 since the last check
    assert control.check(17, False, False) == Decision(report=True)
    assert reductions == ["max", "max"] and watchdog.arms == 2
    assert control._next_check == 17 + 4


def test_the_interval_stays_between_1_and_1000_steps(clock, gloo_group):
    control = Control(True, Stop(), None, save_every_s=None, interval_s=0.25)
    clock.now += 10.0  # a slow step: check at the very next one
    control.check(1, False, False)
    assert control._next_check == 2
    # no time passed at all (a clock too coarse): the next step, not a division by zero
    control.check(2, False, False)
    assert control._next_check == 3
    clock.now += 1e-9  # a blazing step: at most 1000 steps apart
    control.check(3, False, False)
    assert control._next_check == 1003


def test_a_stop_signal_is_seen_at_the_next_check_by_its_name(clock, gloo_group):
    stop = Stop()
    control = Control(True, stop, None, save_every_s=None)
    clock.now += 1 / 64
    assert control.check(1, False, False) == Decision(report=True)
    assert control._next_check == 17
    stop.signal_name = "SIGUSR1"
    for step in range(2, 17):
        assert control.check(step, False, False) == Decision()
    assert control.check(17, False, False) == Decision(stop="SIGUSR1", report=True)


def test_sigterm_survives_the_all_reduce_and_an_unknown_signal_reads_as_sigterm(clock, gloo_group):
    stop = Stop()
    stop.signal_name = "SIGTERM"
    control = Control(True, stop, None, save_every_s=None)
    assert control.check(1, False, False).stop == "SIGTERM"
    stop.signal_name = "SIGINT"
    assert control.check(control._next_check, False, False).stop == "SIGTERM"


def test_save_and_commit_are_agreed_at_a_check(clock, gloo_group):
    control = Control(True, Stop(), None, save_every_s=30.0)
    clock.now += 31.0
    assert control.check(1, async_ready=True, async_pending=True) == Decision(save=True, commit=True, report=True)
    control.saved()
    step = control._next_check
    assert control.check(step, async_ready=False, async_pending=True) == Decision(report=True)
    step = control._next_check
    assert control.check(step, async_ready=True, async_pending=False) == Decision(report=True)


def test_the_loop_reports_its_kept_steps_at_the_controls_check_steps(tmp_path):
    """The Trainer reports (one window, one call to the sinks) when the control says so, and at
    the end: not every log_every steps. Every kept step is in exactly one window."""
    from scaletrain.config import parse_job
    from scaletrain.distributed.device import choose_placement
    from scaletrain.distributed.env import DistEnv
    from scaletrain.engine.trainer import Trainer
    from scaletrain.task import build_task
    from scaletrain.tracking.reporter import NullReporter
    from tests.helpers.tasks import toy_job

    class EverySeventh(Control):
        def check(self, step, async_ready, async_pending):
            return Decision(report=step % 7 == 0)

    class Windows(NullReporter):
        def __init__(self):
            self.windows = []

        def on_train_metrics(self, reports):
            self.windows.append([r.step for r in reports])

    job = parse_job(toy_job(tmp_path, train={"max_steps": 20, "log_every": 2}))
    sink = Windows()
    env = DistEnv()
    Trainer(job, build_task(job.task.target, job.task.args, []), env, choose_placement(env), sink,
            control=EverySeventh(False, None, None, None)).fit()
    assert sink.windows == [[1, 2, 4, 6], [8, 10, 12, 14], [16, 18, 20]]
