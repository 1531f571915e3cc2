"""The opt-in training tricks checked against their formulas, the per-step schedule, the per-class figures,
and the devices beyond CUDA and CPU."""

from __future__ import annotations

import math
import os
import sys

import ddp_workers
import pytest
import torch
from torch import nn

from conftest import free_port
from multi_train_utils import distributed_utils
from multi_train_utils.cli import parse_args
from multi_train_utils.confusion import confusion_image, count_confusion, per_class
from multi_train_utils.ema import ModelEma, build_ema, ema_decay_per_step
from multi_train_utils.errors import UserInputError
from multi_train_utils.step_options import StepOptions
from multi_train_utils.train_eval_utils import align_schedule, build_optimizer, cosine_with_warmup


def test_the_ema_is_the_hand_computed_average_of_the_weights_after_each_step() -> None:
    model = nn.Linear(2, 1)
    ema = ModelEma(model, decay=0.9, batches_per_step=1)
    expected = None
    for value in (1.0, 3.0, -2.0):
        with torch.no_grad():
            model.weight.fill_(value)
        ema.update(model)
        # The first update copies the weights; each later one keeps 0.9 of the average and adds 0.1 of them.
        expected = value if expected is None else 0.9 * expected + 0.1 * value
        assert torch.allclose(ema.model.weight, torch.full((1, 2), expected))
    assert expected == pytest.approx(0.9 * (0.9 * 1 + 0.1 * 3) + 0.1 * -2)


def test_the_ema_decay_follows_the_batches_of_one_step() -> None:
    """4 processes take one step from 4 batches: the average takes 4 times the share of the new weights."""
    assert ema_decay_per_step(0.99, 1) == 0.99
    assert ema_decay_per_step(0.99, 4) == pytest.approx(0.96)
    assert ema_decay_per_step(0.9, 20) == 0.0, "capped: the average is then the weights themselves"


def test_the_ema_and_its_best_accuracy_are_restored_from_a_checkpoint() -> None:
    model = nn.Linear(2, 1)
    ema = ModelEma(model, 0.5, 1)
    ema.update(model)
    with torch.no_grad():
        model.weight.add_(1.0)
    ema.update(model)
    ema.best_acc = 0.75
    saved = {"ema": ema.state_dict()}
    restored = build_ema(nn.Linear(2, 1), True, 0.5, 1, saved)
    assert torch.equal(restored.model.weight, ema.model.weight) and restored.best_acc == 0.75
    assert restored.averaged.n_averaged.item() == 2, "the next update averages, instead of copying again"
    assert build_ema(model, False, 0.5, 1) is None


def test_label_smoothing_is_the_formula_of_its_paper() -> None:
    """Szegedy et al. 2016: the target is 1 - s on the true class plus s/K on each of the K classes."""
    logits, labels = torch.randn(5, 4, generator=torch.Generator().manual_seed(0)), torch.tensor([0, 1, 2, 3, 1])
    smoothing = 0.2
    log_p = logits.log_softmax(dim=1)
    target = torch.full_like(log_p, smoothing / 4) + (1 - smoothing) * nn.functional.one_hot(labels, 4)
    expected = -(target * log_p).sum(dim=1).mean()
    assert StepOptions(label_smoothing=smoothing).loss_function()(logits, labels) == pytest.approx(expected.item())
    plain = StepOptions().loss_function()(logits, labels)
    assert plain == pytest.approx(nn.functional.cross_entropy(logits, labels).item())


def gradient_step(options: StepOptions, gradient: torch.Tensor) -> torch.Tensor:
    """The change one optimizer step (plain SGD, lr 1) makes to a weight whose loss has `gradient`."""
    weight = nn.Parameter(torch.zeros_like(gradient))
    optimizer = torch.optim.SGD([weight], lr=1.0)
    options.scaler.scale((weight * gradient).sum()).backward()
    options.optimizer_step(nn.ParameterList([weight]), optimizer)
    return -weight.detach()


def test_clipping_scales_the_gradients_down_to_the_norm_and_leaves_small_ones() -> None:
    gradient = torch.tensor([3.0, 4.0])  # norm 5
    assert torch.allclose(gradient_step(StepOptions(clip_grad_norm=1.0), gradient), gradient / 5, atol=1e-6)
    assert torch.equal(gradient_step(StepOptions(clip_grad_norm=10.0), gradient), gradient)
    assert torch.equal(gradient_step(StepOptions(), gradient), gradient)


def test_loss_scaled_gradients_are_unscaled_before_clipping() -> None:
    """fp16's loss scale multiplies the gradients by 1024 here: clipped as they are, every step would be cut
    to the limit; unscaled first, a small gradient passes whole."""
    scaled = StepOptions(clip_grad_norm=10.0, scaler=torch.amp.GradScaler("cpu", init_scale=1024.0))
    assert torch.allclose(gradient_step(scaled, torch.tensor([3.0, 4.0])), torch.tensor([3.0, 4.0]))


def test_the_warmup_rises_every_optimizer_step() -> None:
    factor = cosine_with_warmup(epochs=3, lrf=0.1, warmup_epochs=1, steps_per_epoch=4)
    assert [factor(step) for step in range(5)] == [0.2, 0.4, 0.6, 0.8, 1.0]
    assert factor(12) == pytest.approx(0.1)
    assert math.isclose(factor(8), 0.55), "the cosine, too, is per step: half way at step 4 + 8/2"


def test_a_resumed_schedule_is_put_at_this_runs_step() -> None:
    """Resumed with half the processes, an epoch takes twice the steps: epoch 1 starts at step 8, not 4."""
    optimizer, scheduler = build_optimizer(ddp_workers.small_net(), lr=1.0, epochs=4, warmup_epochs=1,
                                           steps_per_epoch=8)
    scheduler.last_epoch = 4
    align_schedule(scheduler, 8)
    assert scheduler.last_epoch == 8 and optimizer.param_groups[0]["lr"] == 1.0


def test_the_confusion_matrix_counts_true_rows_and_predicted_columns() -> None:
    labels, predictions = torch.tensor([0, 0, 1, 2, 2, 2]), torch.tensor([0, 1, 1, 2, 0, 2])
    matrix = count_confusion(labels, predictions, 3).tolist()
    assert matrix == [[1, 1, 0], [0, 1, 0], [1, 0, 2]]
    figures = per_class(matrix, ["a", "b", "c"])
    assert figures["a"] == {"precision": 0.5, "recall": 0.5, "count": 2}
    assert figures["c"] == {"precision": 1.0, "recall": pytest.approx(2 / 3), "count": 3}
    assert per_class([[0, 0], [2, 0]], ["x", "y"])["y"] == {"precision": 0.0, "recall": 0.0, "count": 2}
    picture = confusion_image(matrix, ["a", "b", "a much longer name"])
    assert picture.mode == "RGB" and picture.width > 3 * 44 and picture.height > 3 * 44


@pytest.mark.parametrize(("argv", "message"), [
    (["--label-smoothing", "1"], "must be at least 0 and below 1"),
    (["--label-smoothing", "nan"], "must be at least 0 and below 1"),
    (["--model-ema-decay", "1"], "must be at least 0 and below 1"),
    (["--model-ema-decay", "0"], "must be above 0"),
    (["--clip-grad-norm", "0"], "must be a finite number above 0"),
    (["--clip-grad-norm", "inf"], "must be a finite number above 0"),
])
def test_trick_flags_out_of_range_are_one_line(argv: list[str], message: str,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        parse_args("single", argv)
    assert stop.value.code == 2 and message in capsys.readouterr().err


def test_mps_is_for_one_process(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    with pytest.raises(UserInputError, match=r"^--device mps: no Apple GPU is available here"):
        distributed_utils.resolve_device("mps", 0, distributed=False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    assert distributed_utils.resolve_device("mps", 0, distributed=False) == torch.device("mps")
    assert parse_args("single", ["--device", "mps"]).device == "mps"
    for launcher in ("launch", "spawn"):
        with pytest.raises(SystemExit):
            parse_args(launcher, ["--device", "mps"])
        assert "DistributedDataParallel has no backend for Apple GPUs" in capsys.readouterr().err


def test_windows_takes_gloo_and_a_store_without_libuv(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a Linux box can check of Windows: the backend and store settings chosen, and a process group of
    one that really starts with them (gloo, the TCPStore without libuv)."""
    cuda = torch.device("cuda", 0)
    assert distributed_utils.process_group_backend(cuda) == "nccl" and distributed_utils.tcp_store_uses_libuv()
    monkeypatch.setattr(sys, "platform", "win32")
    assert distributed_utils.process_group_backend(cuda) == "gloo"
    assert distributed_utils.process_group_backend(torch.device("cpu")) == "gloo"
    assert not distributed_utils.tcp_store_uses_libuv()
    monkeypatch.delenv("USE_LIBUV", raising=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    monkeypatch.setattr(distributed_utils, "stop_when_launcher_dies", lambda: None)
    ctx = distributed_utils.init_distributed_mode("cpu", spawn_rank=0, spawn_world_size=1)
    try:
        assert os.environ["USE_LIBUV"] == "0" and torch.distributed.get_backend() == "gloo"
    finally:
        distributed_utils.cleanup()
    assert ctx.distributed

