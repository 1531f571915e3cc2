"""What rank 0 writes for TensorBoard, read back with TensorBoard's own event reader."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn

import train_single_gpu
from conftest import TINY_FLAGS
from multi_train_utils.cli import parse_args
from multi_train_utils.distributed_utils import DistContext, single_process
from multi_train_utils.recorder import RunRecorder
from multi_train_utils.tensorboard_log import TensorBoardLog
from multi_train_utils.transforms import IMAGENET_MEAN, IMAGENET_STD

SCALARS = ("train_loss", "val_loss", "val_acc", "lr", "images_per_s", "epoch_time_s")
CLASSES = ["red", "green", "blue"]
SPLIT = {"class_names": CLASSES, "train": ["red/1.jpg"], "val": ["red/2.jpg"]}


def read_events(output_dir: Path) -> EventAccumulator:
    # size_guidance 0: keep every event (the default keeps only a sample of images and scalars).
    events = EventAccumulator(str(output_dir / "tensorboard"), size_guidance={"images": 0, "scalars": 0})
    events.Reload()
    return events


def normalised_batch(colours: list[tuple[int, int, int]], side: int = 16) -> torch.Tensor:
    """Solid-colour images, normalised as the data loader normalises them."""
    pixels = torch.tensor(colours, dtype=torch.float32).view(-1, 3, 1, 1).expand(-1, 3, side, side) / 255
    return (pixels - torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)) / torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)


def epoch_metrics(epoch: int) -> dict:
    return {"epoch": epoch, "train_loss": 1.0 / (epoch + 1), "val_loss": 1.5 / (epoch + 1), "val_acc": 0.5 + epoch / 10,
            "val_correct": 5 + epoch, "val_total": 10, "lr": 0.01 / (epoch + 1), "images_per_s": 100.0 + epoch,
            "epoch_time_s": 3.0, "world_size": 1,
            "confusion_matrix": [[3, 1, 0], [0, 2 + epoch, 1 - epoch // 2], [0, 0, 3]]}


def record(recorder: RunRecorder, epochs: int, first_batch: torch.Tensor | None = None) -> None:
    """What fit does with the recorder and the TensorBoard hook, for `epochs` epochs."""
    log = TensorBoardLog(recorder)
    for epoch in range(epochs):
        log.on_epoch_start(epoch)
        if first_batch is not None:
            log.on_first_batch(first_batch, torch.arange(len(first_batch)))
        recorder.end_epoch(nn.Linear(2, 3), epoch_metrics(epoch), improved=True)
        log.on_epoch_end(epoch, epoch_metrics(epoch))
    log.on_fit_end()


def test_events_hold_every_scalar_once_per_epoch_the_batch_grid_and_the_args(tmp_path: Path) -> None:
    with RunRecorder(tmp_path, single_process("cpu"), SPLIT, {"lr": 0.01, "model": "resnet18"}) as recorder:
        record(recorder, 3, normalised_batch([(255, 0, 0), (0, 255, 0), (0, 0, 255)]))
    events = read_events(tmp_path)
    assert set(events.Tags()["scalars"]) == set(SCALARS), "every float of the metrics: no list to edit"
    for name in SCALARS:
        points = events.Scalars(name)
        assert [p.step for p in points] == [0, 1, 2], name
        assert [p.value for p in points] == [torch.tensor(epoch_metrics(e)[name]).item() for e in range(3)], name
    (grid,) = events.Images("first_training_batch")
    assert grid.step == 0
    with Image.open(io.BytesIO(grid.encoded_image_string)) as picture:
        # Three 128-px tiles in a row, un-normalised: the first tile is red again, the third blue.
        assert picture.size == (3 * 128, 128 + 14)
        assert picture.convert("RGB").getpixel((64, 64)) == (255, 0, 0)
        assert picture.convert("RGB").getpixel((2 * 128 + 64, 64)) == (0, 0, 255)
    (args_text,) = events.Tensors("args/text_summary")
    assert "| model | resnet18 |" in args_text.tensor_proto.string_val[0].decode()


def test_other_ranks_write_nothing(tmp_path: Path) -> None:
    rank1 = DistContext(rank=1, local_rank=1, world_size=2, local_world_size=2, device=torch.device("cpu"),
                        distributed=True)
    with RunRecorder(tmp_path / "run", rank1, SPLIT, {}) as recorder:
        record(recorder, 1, normalised_batch([(255, 0, 0)]))
        recorder.write_checkpoint({"model": {}, "epoch": 0})
    assert not (tmp_path / "run").exists()


def test_a_real_run_shows_every_scalar_per_epoch_and_its_first_batch(image_folder: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    train_single_gpu.main(parse_args("single", ["--data-path", str(image_folder), "--output-dir", str(out),
                                                *TINY_FLAGS, "--epochs", "2"]))
    events = read_events(out)
    for name in SCALARS:
        assert [p.step for p in events.Scalars(name)] == [0, 1], name
    (grid,) = events.Images("first_training_batch")
    assert grid.step == 0
    with Image.open(io.BytesIO(grid.encoded_image_string)) as picture:
        assert picture.size == (4 * 128, 128 + 14), "the whole first batch of 4, one row"


def test_save_every_and_keep_epoch_weights_decide_what_is_written(tmp_path: Path) -> None:
    """--save-every 2 --keep-epoch-weights false: the checkpoint after epochs 1, 3 and the last (4),
    best.pth when the accuracy improved, and no model-{epoch}.pth."""
    args = {"save_every": 2, "keep_epoch_weights": False}
    with RunRecorder(tmp_path, single_process("cpu"), SPLIT, args) as recorder:
        due = [epoch for epoch in range(5) if recorder.checkpoint_due(epoch, last_epoch=4)]
        for epoch in range(5):
            recorder.end_epoch(nn.Linear(2, 3), epoch_metrics(epoch), improved=epoch == 1)
        recorder.write_checkpoint({"model": {}, "epoch": due[-1]})
    assert due == [1, 3, 4]
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["best.pth"]
    assert torch.load(tmp_path / "checkpoint.pth", weights_only=True)["epoch"] == 4


def test_by_default_every_epoch_keeps_its_weights_and_a_checkpoint(tmp_path: Path) -> None:
    with RunRecorder(tmp_path, single_process("cpu"), SPLIT, {}) as recorder:
        assert all(recorder.checkpoint_due(epoch, last_epoch=9) for epoch in range(10))
        recorder.end_epoch(nn.Linear(2, 3), epoch_metrics(0), improved=False)
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["model-0.pth"]


def test_the_tensorboard_hint_quotes_a_path_with_spaces(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "my runs" / "run 1"
    with RunRecorder(out, single_process("cpu"), SPLIT, {}) as recorder:
        TensorBoardLog(recorder).on_fit_end()
    assert f"tensorboard --logdir '{out}'" in capsys.readouterr().out
