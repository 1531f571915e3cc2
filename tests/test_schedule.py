"""The learning-rate schedules: optional linear warm-up, then the tutorial's cosine from 1 down to lrf, a step
schedule or a constant one; the optimizer's weight decay only where it belongs."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from multi_train_utils.optim import build_optimizer, build_scheduler, constant, cosine, step, warmup_then


def test_cosine_starts_at_one_and_approaches_lrf() -> None:
    factor = warmup_then(cosine, 0.1, warmup_steps=0, total_steps=10)
    assert factor(0) == 1.0
    assert factor(5) == pytest.approx(0.55)
    assert factor(10) == pytest.approx(0.1)
    assert all(factor(e) > factor(e + 1) for e in range(10))


def test_warmup_rises_linearly_then_the_cosine_starts_from_one() -> None:
    factor = warmup_then(cosine, 0.1, warmup_steps=3, total_steps=10)
    assert [factor(e) for e in range(3)] == [0.25, 0.5, 0.75]
    assert factor(3) == 1.0
    assert factor(10) == pytest.approx(0.1)
    assert math.isclose(factor(3 + 7 / 2), 0.55)


def test_the_step_schedule_divides_by_ten_after_each_third_and_constant_stays() -> None:
    factor = warmup_then(step, 0.1, warmup_steps=2, total_steps=14)
    assert [factor(s) for s in (0, 1)] == pytest.approx([1 / 3, 2 / 3]), "the same warm-up before any schedule"
    assert [factor(s) for s in (2, 5, 6, 9, 10, 13)] == pytest.approx([1, 1, 0.1, 0.1, 0.01, 0.01])
    assert [warmup_then(constant, 0.1, 2, 14)(s) for s in (1, 2, 13)] == pytest.approx([2 / 3, 1, 1])


def test_weight_decay_spares_biases_and_normalisation_layers() -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4, 2))
    optimizer = build_optimizer(model, "adamw", lr=0.1, weight_decay=0.05)
    assert isinstance(optimizer, torch.optim.AdamW)
    decayed, plain = optimizer.param_groups
    assert decayed["weight_decay"] == 0.05 and plain["weight_decay"] == 0.0
    assert {id(p) for p in decayed["params"]} == {id(model[0].weight), id(model[3].weight)}
    assert len(plain["params"]) == 4, "two biases, and BatchNorm's weight and bias"
    assert build_optimizer(model, "sgd").param_groups[0]["weight_decay"] == 5e-3, "each optimizer's own default"


def test_the_schedule_is_chosen_by_name_and_moves_every_step() -> None:
    optimizer = build_optimizer(nn.Linear(2, 2), "sgd", lr=1.0)
    scheduler = build_scheduler(optimizer, "step", epochs=3, steps_per_epoch=2)
    lrs = []
    for _ in range(6):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert lrs == pytest.approx([1, 1, 0.1, 0.1, 0.01, 0.01])
    assert all(group["lr"] == lrs[-1] for group in optimizer.param_groups[1:]), "every group follows it"
