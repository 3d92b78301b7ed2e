import sys

import pytest
import torch

from scaletrain.errors import TaskError
from scaletrain.task import (
    build_task,
    check_task_args,
    check_task_target,
    resolve_task_factory,
    split_loss_output,
)


def test_resolves_a_class():
    factory = resolve_task_factory("tests.helpers.tasks:ToyTask")
    assert factory.__name__ == "ToyTask"


@pytest.mark.parametrize(
    "target, message",
    [
        ("nosuchpkg.tasks:Task", "task.target 'nosuchpkg.tasks:Task': module 'nosuchpkg' not found"),
        ("tests.helpers.nothere:Task", "module 'tests.helpers.nothere' not found"),
        ("tests.helpers.tasks:ToyTsk", "'tests.helpers.tasks' has no attribute 'ToyTsk'; did you mean 'ToyTask'?"),
        ("tests.helpers.tasks:REPO", "has no attribute 'REPO'"),
        ("tests.helpers.run:REPO", "is not a class or function"),
    ],
)
def test_unresolvable_targets_say_what_is_wrong(target, message):
    with pytest.raises(TaskError) as info:
        resolve_task_factory(target)
    assert message in str(info.value)


def test_args_are_checked_against_the_signature():
    factory = resolve_task_factory("tests.helpers.tasks:ToyTask")
    check_task_args(factory, {"samples": 10}, "t")
    with pytest.raises(TaskError, match="unexpected keyword argument 'hiden'"):
        check_task_args(factory, {"hiden": 10}, "tests.helpers.tasks:ToyTask")


def test_task_without_loss_is_rejected():
    with pytest.raises(TaskError, match=r"lacks loss\(\)"):
        build_task("tests.helpers.tasks:NoMethodsTask", {})


def test_loss_output_forms():
    loss = torch.tensor(1.0)
    assert split_loss_output(loss) == (loss, {})
    assert split_loss_output((loss, {"acc": 1})) == (loss, {"acc": 1})
    assert split_loss_output({"loss": loss, "acc": 2}) == (loss, {"acc": 2})


@pytest.mark.parametrize(
    "target, args, message",
    [
        ("tests.helpers.tasks:ToyTask", {"sample": 1}, "takes no argument 'sample'; did you mean 'samples'?"),
        ("tests.helpers.tasks:ToyTsk", {}, "has no attribute 'ToyTsk'; did you mean 'ToyTask'?"),
        ("nosuch.mod:X", {}, "module 'nosuch' not found"),
        ("tests.helpers.tasks:toy_job", {}, "needs 'tmp_path'; add it under task.args"),
    ],
)
def test_static_check_catches_what_the_import_would(target, args, message):
    with pytest.raises(TaskError) as info:
        check_task_target(target, args)
    assert message in str(info.value)


def test_static_check_does_not_run_the_module(tmp_path):
    module = tmp_path / "sideeffect_task.py"
    module.write_text("raise SystemExit('imported!')\nclass T:\n    def __init__(self, a, b=1): ...\n")
    check_task_target("sideeffect_task:T", {"a": 1}, [str(tmp_path)])
    assert "sideeffect_task" not in sys.modules
    with pytest.raises(TaskError, match="needs 'a'"):
        check_task_target("sideeffect_task:T", {"b": 2}, [str(tmp_path)])
    broken = tmp_path / "broken_task.py"
    broken.write_text("def f(:\n")
    with pytest.raises(TaskError, match="line 1: SyntaxError"):
        check_task_target("broken_task:f", {}, [str(tmp_path)])
