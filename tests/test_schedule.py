"""The learning-rate schedule: optional linear warm-up, then the tutorial's cosine from 1 down to lrf."""

from __future__ import annotations

import math

import pytest

from multi_train_utils.train_eval_utils import cosine_with_warmup


def test_cosine_starts_at_one_and_approaches_lrf() -> None:
    factor = cosine_with_warmup(epochs=10, lrf=0.1)
    assert factor(0) == 1.0
    assert factor(5) == pytest.approx(0.55)
    assert factor(10) == pytest.approx(0.1)
    assert all(factor(e) > factor(e + 1) for e in range(10))


def test_warmup_rises_linearly_then_the_cosine_starts_from_one() -> None:
    factor = cosine_with_warmup(epochs=10, lrf=0.1, warmup_epochs=3)
    assert [factor(e) for e in range(3)] == [0.25, 0.5, 0.75]
    assert factor(3) == 1.0
    assert factor(10) == pytest.approx(0.1)
    assert math.isclose(factor(3 + 7 / 2), 0.55)
