import pytest
import torch

from scaletrain.engine.schedule import LRSchedule, build_scheduler


def test_warmup_then_cosine_to_min():
    s = LRSchedule("cosine", warmup_steps=4, total_steps=14, min_ratio=0.1)
    assert [s(i) for i in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert s(4) == pytest.approx(1.0)
    assert s(9) == pytest.approx(0.1 + 0.9 * 0.5)
    assert s(14) == pytest.approx(0.1)
    assert s(100) == pytest.approx(0.1)


def test_linear_and_constant():
    linear = LRSchedule("linear", warmup_steps=0, total_steps=10)
    assert [linear(i) for i in (0, 5, 10)] == pytest.approx([1.0, 0.5, 0.0])
    constant = LRSchedule("constant", warmup_steps=2, total_steps=10)
    assert [constant(i) for i in (0, 1, 2, 9)] == [0.5, 1.0, 1.0, 1.0]


def test_scheduler_drives_the_optimizer_lr():
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=2.0)
    scheduler = build_scheduler(optimizer, LRSchedule("linear", 0, 4))
    seen = []
    for _ in range(4):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert seen == pytest.approx([2.0, 1.5, 1.0, 0.5])
    assert "lr_lambdas" in scheduler.state_dict()
