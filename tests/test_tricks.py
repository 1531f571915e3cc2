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
from torch.utils.data import DataLoader, TensorDataset

from conftest import free_port
from multi_train_utils import distributed_utils, launch
from multi_train_utils.cli import parse_args
from multi_train_utils.confusion import class_figures, class_sums, confusion_image, per_class
from multi_train_utils.ema import ModelEma, ema_decay_per_step
from multi_train_utils.errors import UserInputError
from multi_train_utils.optim import StepOptions, align_schedule, build_optimizer, build_scheduler, cosine, warmup_then
from multi_train_utils.train_eval_utils import train_one_epoch


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
    ema.best.value = 0.75
    restored = ModelEma(nn.Linear(2, 1), 0.5, 1)
    restored.load_state_dict(ema.state_dict())
    assert torch.equal(restored.model.weight, ema.model.weight) and restored.best.value == 0.75
    assert restored.averaged.n_averaged.item() == 2, "the next update averages, instead of copying again"
    by_loss = ModelEma(nn.Linear(2, 1), 0.5, 1, best_metric="val_loss")
    by_loss.load_state_dict(ema.state_dict())
    assert by_loss.best.value is None, "the best by another metric is not this run's best"


def one_step(options: StepOptions, logits: torch.Tensor, labels: torch.Tensor,
             criterion: nn.Module | None = None) -> tuple[float, torch.Tensor]:
    """One optimizer step of the training loop (plain SGD, lr 1) on a model that passes `logits` through its
    weights: (the loss the loop reports, the change the step made to the weights)."""
    model = nn.Linear(logits.shape[1], logits.shape[1])
    with torch.no_grad():
        model.weight.copy_(torch.eye(logits.shape[1]))
        model.bias.zero_()
    before = model.weight.detach().clone()
    loader = DataLoader(TensorDataset(logits, labels), batch_size=len(labels))
    loss = train_one_epoch(model, criterion or nn.CrossEntropyLoss(), torch.optim.SGD(model.parameters(), lr=1.0),
                           loader, torch.device("cpu"), 0, options=options)
    return loss, before - model.weight.detach()


LOGITS, LABELS = torch.randn(5, 4, generator=torch.Generator().manual_seed(0)), torch.tensor([0, 1, 2, 3, 1])


def test_label_smoothing_is_the_formula_of_its_paper() -> None:
    """Szegedy et al. 2016: the target is 1 - s on the true class plus s/K on each of the K classes."""
    smoothing = 0.2
    log_p = LOGITS.log_softmax(dim=1)
    target = torch.full_like(log_p, smoothing / 4) + (1 - smoothing) * nn.functional.one_hot(LABELS, 4)
    expected = -(target * log_p).sum(dim=1).mean()
    smoothed = nn.CrossEntropyLoss(label_smoothing=smoothing)  # what the scripts build from --label-smoothing
    assert one_step(StepOptions(), LOGITS, LABELS, smoothed)[0] == pytest.approx(expected.item())
    plain = one_step(StepOptions(), LOGITS, LABELS)[0]
    assert plain == pytest.approx(nn.functional.cross_entropy(LOGITS, LABELS).item())


def test_clipping_scales_the_gradients_down_to_the_norm_and_leaves_small_ones() -> None:
    _, step = one_step(StepOptions(), LOGITS, LABELS)  # lr 1: the step is the gradient of the weight
    bias_step = one_step(StepOptions(), LOGITS, LABELS)  # the same again: the loop is deterministic
    assert torch.equal(step, bias_step[1])
    norm = torch.linalg.vector_norm(step)  # of the weight alone; the bias adds to the norm clipping sees
    _, clipped = one_step(StepOptions(clip_grad_norm=norm.item() / 10), LOGITS, LABELS)
    assert torch.linalg.vector_norm(clipped) < norm / 9, "scaled down to the limit"
    assert torch.allclose(clipped / torch.linalg.vector_norm(clipped), step / norm, atol=1e-5), "same direction"
    assert torch.equal(one_step(StepOptions(clip_grad_norm=100.0), LOGITS, LABELS)[1], step), "small ones pass"


def test_loss_scaled_gradients_are_unscaled_before_clipping() -> None:
    """fp16's loss scale multiplies the gradients by 1024 here: clipped as they are, every step would be cut
    to the limit; unscaled first, a small gradient passes whole."""
    _, step = one_step(StepOptions(), LOGITS, LABELS)
    scaled = StepOptions(clip_grad_norm=100.0, scaler=torch.amp.GradScaler("cpu", init_scale=1024.0))
    assert torch.allclose(one_step(scaled, LOGITS, LABELS)[1], step, atol=1e-6)


def test_the_warmup_rises_every_optimizer_step() -> None:
    factor = warmup_then(cosine, 0.1, warmup_steps=4, total_steps=12)
    assert [factor(step) for step in range(5)] == [0.2, 0.4, 0.6, 0.8, 1.0]
    assert factor(12) == pytest.approx(0.1)
    assert math.isclose(factor(8), 0.55), "the cosine, too, is per step: half way at step 4 + 8/2"


def test_a_resumed_schedule_is_put_at_this_runs_step() -> None:
    """Resumed with half the processes, an epoch takes twice the steps: epoch 1 starts at step 8, not 4."""
    optimizer = build_optimizer(ddp_workers.small_net(), lr=1.0)
    scheduler = build_scheduler(optimizer, epochs=4, steps_per_epoch=8, warmup_epochs=1)
    scheduler.last_epoch = 4
    align_schedule(scheduler, 8)
    assert scheduler.last_epoch == 8 and optimizer.param_groups[0]["lr"] == 1.0


def test_the_confusion_matrix_counts_true_rows_and_predicted_columns() -> None:
    labels, predictions = torch.tensor([0, 0, 1, 2, 2, 2]), torch.tensor([0, 1, 1, 2, 0, 2])
    sums = class_sums(labels, predictions, 3)
    assert sums["confusion"].tolist() == [[1, 1, 0], [0, 1, 0], [1, 0, 2]]
    figures = per_class(sums, ["a", "b", "c"])
    assert figures["a"] == {"precision": 0.5, "recall": 0.5, "count": 2}
    assert figures["c"] == {"precision": 1.0, "recall": pytest.approx(2 / 3), "count": 3}
    never_predicted = class_sums(torch.tensor([1, 1]), torch.tensor([0, 0]), 2)
    assert per_class(never_predicted, ["x", "y"])["y"] == {"precision": 0.0, "recall": 0.0, "count": 2}
    assert class_figures(sums, ["a", "b", "c"])["confusion_matrix"] == [[1, 1, 0], [0, 1, 0], [1, 0, 2]]
    picture = confusion_image(sums["confusion"], ["a", "b", "a much longer name"])
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
    with pytest.raises(UserInputError, match=f"^argument {argv[0]}: .*{message}"):
        parse_args("single", argv)


def test_mps_is_for_one_process(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    with pytest.raises(UserInputError, match=r"^--device mps: no Apple GPU is available here"):
        launch.resolve_device("mps", 0, distributed=False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    assert launch.resolve_device("mps", 0, distributed=False) == torch.device("mps")
    assert parse_args("single", ["--device", "mps"]).device == "mps"
    for launcher in ("launch", "spawn"):
        with pytest.raises(UserInputError, match="DistributedDataParallel has no backend for Apple GPUs"):
            parse_args(launcher, ["--device", "mps"])


def test_windows_takes_gloo_and_a_store_without_libuv(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a Linux box can check of Windows: the backend and store settings chosen, and a process group of
    one that really starts with them (gloo, the TCPStore without libuv)."""
    cuda = torch.device("cuda", 0)
    assert distributed_utils.process_group_backend(cuda) == "nccl" and launch.tcp_store_uses_libuv()
    monkeypatch.setattr(sys, "platform", "win32")
    assert distributed_utils.process_group_backend(cuda) == "gloo"
    assert distributed_utils.process_group_backend(torch.device("cpu")) == "gloo"
    assert not launch.tcp_store_uses_libuv()
    monkeypatch.delenv("USE_LIBUV", raising=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    ctx = distributed_utils.init_distributed_mode("cpu", spawn_rank=0, spawn_world_size=1)
    try:
        assert os.environ["USE_LIBUV"] == "0" and torch.distributed.get_backend() == "gloo"
    finally:
        distributed_utils.cleanup()
    assert ctx.distributed

