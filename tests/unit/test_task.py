import pytest
import torch

from scaletrain.errors import TaskError
from scaletrain.task import build_task, check_task_args, resolve_task_factory, split_loss_output


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
