"""What rank 0 writes: metrics.jsonl, weights, and TensorBoard's events (read back with TensorBoard's own event
reader), counted in optimizer steps, so that a resumed run's per-step curves go on where its checkpoint was."""

from __future__ import annotations

import io
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn

import train_single_gpu
from conftest import TINY_FLAGS, config_in, make_image_folder
from multi_train_utils import checkpoint
from multi_train_utils.cli import parse_args
from multi_train_utils.distributed_utils import DistContext, single_process
from multi_train_utils.errors import UserInputError
from multi_train_utils.optim import IMAGENET_MEAN, IMAGENET_STD, StepEnd
from multi_train_utils.recorder import STEP_LOG_EVERY, RunRecorder, SavedRun, claim_folder

SCALARS = ("train_loss", "val_loss", "val_acc", "lr", "images_per_s", "epoch_time_s")
CLASSES = ["red", "green", "blue"]
SPLIT = {"class_names": CLASSES, "train": ["red/1.jpg"], "val": ["red/2.jpg"]}
STEPS_PER_EPOCH = 20


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
            "epoch_time_s": 3.0, "world_size": 1}


def step_end(epoch: int, step: int) -> StepEnd:
    zero = torch.zeros(())
    return StepEnd(epoch, step, STEPS_PER_EPOCH, step, zero, zero, nn.Linear(2, 3),
                   {"loss": torch.tensor(1.0 / (1 + epoch * STEPS_PER_EPOCH + step)), "lr": 0.1})


def record(recorder: RunRecorder, epochs: range, first_batch: torch.Tensor | None = None,
           stop_at: int | None = None) -> None:
    """What fit does with the recorder, for `epochs`, each of STEPS_PER_EPOCH steps (stopping after run step
    `stop_at`, as a killed run would)."""
    for epoch in epochs:
        if first_batch is not None:
            recorder.on_first_batch(first_batch, torch.arange(len(first_batch)))
        for step in range(1, STEPS_PER_EPOCH + 1):
            recorder.on_step_end(step_end(epoch, step))
            if stop_at is not None and epoch * STEPS_PER_EPOCH + step == stop_at:
                return
        confusion = torch.tensor([[3, 1, 0], [0, 2 + epoch, 1 - epoch // 2], [0, 0, 3]])
        recorder.end_epoch(nn.Linear(2, 3), epoch_metrics(epoch), confusion, improved=True,
                           run_step=(epoch + 1) * STEPS_PER_EPOCH)


def test_events_hold_every_scalar_at_its_step_the_batch_grid_and_the_args(tmp_path: Path) -> None:
    with RunRecorder(config_in(tmp_path, lr=0.01, model="resnet18"), single_process("cpu"), SPLIT) as recorder:
        record(recorder, range(3), normalised_batch([(255, 0, 0), (0, 255, 0), (0, 0, 255)]))
    events = read_events(tmp_path)
    assert set(SCALARS) <= set(events.Tags()["scalars"]), "every float of the metrics: no list to edit"
    for name in SCALARS:
        points = events.Scalars(name)
        assert [p.step for p in points] == [20, 40, 60], name
        assert [p.value for p in points] == [torch.tensor(epoch_metrics(e)[name]).item() for e in range(3)], name
    assert [p.step for p in events.Scalars("step/loss")] == list(range(STEP_LOG_EVERY, 61, STEP_LOG_EVERY))
    (grid,) = events.Images("first_training_batch")
    assert grid.step == 0
    with Image.open(io.BytesIO(grid.encoded_image_string)) as picture:
        # Three 128-px tiles in a row, un-normalised: the first tile is red again, the third blue.
        assert picture.size == (3 * 128, 128 + 14)
        assert picture.convert("RGB").getpixel((64, 64)) == (255, 0, 0)
        assert picture.convert("RGB").getpixel((2 * 128 + 64, 64)) == (0, 0, 255)
    assert [image.step for image in events.Images("confusion_matrix")] == [20, 40, 60]
    (args_text,) = events.Tensors("args/text_summary")
    assert "| model | resnet18 |" in args_text.tensor_proto.string_val[0].decode()


def test_a_resumed_run_keeps_the_curves_up_to_its_checkpoint_and_drops_the_rest(tmp_path: Path) -> None:
    """Killed at step 47, resumed from the checkpoint of step 30 (epoch 1, step 10): the points up to step 30
    stay, those the killed run drew after it go, and the resumed run draws on from step 31."""
    with RunRecorder(config_in(tmp_path), single_process("cpu"), SPLIT) as killed:
        record(killed, range(3), stop_at=47)
    saved = SavedRun(str(tmp_path / "checkpoint.pth"), {"epoch": 0, "progress": {"epoch": 1, "step": 10}})
    with RunRecorder(config_in(tmp_path), single_process("cpu"), SPLIT, saved) as resumed:
        for step in range(11, STEPS_PER_EPOCH + 1):
            resumed.on_step_end(step_end(1, step))
        resumed.end_epoch(nn.Linear(2, 3), epoch_metrics(1), None, improved=False, run_step=40)
    events = read_events(tmp_path)
    assert [p.step for p in events.Scalars("step/loss")] == [10, 20, 30, 40], "no point lost, none twice"
    assert [p.step for p in events.Scalars("val_acc")] == [20, 40]


def test_other_ranks_write_nothing(tmp_path: Path) -> None:
    rank1 = DistContext(rank=1, local_rank=1, world_size=2, local_world_size=2, device=torch.device("cpu"),
                        distributed=True)
    with RunRecorder(config_in(tmp_path / "run"), rank1, SPLIT) as recorder:
        record(recorder, range(1), normalised_batch([(255, 0, 0)]))
    assert not (tmp_path / "run").exists()


def test_a_real_run_shows_every_scalar_per_epoch_and_its_first_batch(image_folder: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    train_single_gpu.main(parse_args("single", ["--data-path", str(image_folder), "--output-dir", str(out),
                                                *TINY_FLAGS, "--epochs", "2"]))
    events = read_events(out)
    for name in SCALARS:
        assert [p.step for p in events.Scalars(name)] == [6, 12], name  # 24 images, batches of 4
    assert [p.step for p in events.Scalars("step/lr")] == [10]
    (grid,) = events.Images("first_training_batch")
    assert grid.step == 0
    with Image.open(io.BytesIO(grid.encoded_image_string)) as picture:
        assert picture.size == (4 * 128, 128 + 14), "the whole first batch of 4, one row"


def test_save_every_and_keep_epoch_weights_decide_what_is_written(tmp_path: Path) -> None:
    """--save-every 2 --keep-epoch-weights false: the checkpoint after epochs 1, 3 and the last (4),
    best.pth when the accuracy improved, and no model-{epoch}.pth."""
    with RunRecorder(config_in(tmp_path, save_every=2, keep_epoch_weights=False), single_process("cpu"),
                     SPLIT) as recorder:
        due = [epoch for epoch in range(5) if recorder.checkpoint_due(epoch, last_epoch=4)]
        for epoch in range(5):
            recorder.end_epoch(nn.Linear(2, 3), epoch_metrics(epoch), None, improved=epoch == 1, run_step=epoch)
    assert due == [1, 3, 4]
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["best.pth"]


@pytest.mark.parametrize(("flag", "kept"), [([], [1, 5, 6, 7]), (["--keep-epoch-weights", "1"], [1, 7]),
                                            (["--keep-epoch-weights", "all"], list(range(8))),
                                            (["--keep-epoch-weights", "true"], list(range(8)))])
def test_by_default_every_epoch_writes_a_checkpoint_and_the_newest_three_and_the_best_keep_their_weights(
        tmp_path: Path, flag: list[str], kept: list[int]) -> None:
    """A 16-epoch run that kept every epoch's ResNet-34 weights wrote 1.6 GB."""
    config = parse_args("single", ["--output-dir", str(tmp_path), *flag])
    with RunRecorder(config, single_process("cpu"), SPLIT) as recorder:
        assert all(recorder.checkpoint_due(epoch, last_epoch=9) for epoch in range(10))
        for epoch in range(8):  # epoch 1 the best
            recorder.end_epoch(nn.Linear(2, 3), epoch_metrics(epoch), None, improved=epoch == 1, run_step=epoch,
                               best_epoch=0 if epoch == 0 else 1)
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == sorted(
        ["best.pth", *(f"model-{epoch}.pth" for epoch in kept)])


def test_the_tensorboard_hint_quotes_a_path_with_spaces(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "my runs" / "run 1"
    with RunRecorder(config_in(out), single_process("cpu"), SPLIT):
        pass
    assert f"tensorboard --logdir '{out}'" in capsys.readouterr().out


@pytest.mark.parametrize("classes", [1000, 21_841])
def test_many_classes_keep_each_line_small_and_the_picture_bounded(tmp_path: Path, classes: int) -> None:
    """ImageNet's 1000 classes (and 21k's 21,841): the counts stay exact; a metrics.jsonl line names the classes
    confused most instead of a million counts, the whole matrix (where it is counted) has a file of its own,
    and the picture shows the classes confused most."""
    from multi_train_utils.confusion import MAX_PICTURE_CLASSES, class_figures, class_sums, per_class

    generator = torch.Generator().manual_seed(0)
    labels = torch.randint(0, classes, (5000,), generator=generator)
    predictions = torch.where(torch.rand(5000, generator=generator) < 0.3, (labels + 1) % classes, labels)
    labels[:40], predictions[:40] = 3, 7  # class 3 taken for class 7 the most
    sums = class_sums(labels, predictions, classes)
    names = [f"class_{index:05d}" for index in range(classes)]
    figures = class_figures(sums, names)
    assert len(json.dumps(figures)) < 5000 and "confusion_matrix" not in figures
    assert sum(per["count"] for per in per_class(sums, names).values()) == 5000
    if classes > 1024:
        assert "confusion" not in sums and figures == {}, "per-class counts only: 21,841 squared counts is 3.8 GB"
        return
    assert figures["most_confused"][0] == {"true": "class_00003", "predicted": "class_00007", "count": 40}
    with RunRecorder(config_in(tmp_path), single_process("cpu"), {"class_names": names}) as recorder:
        recorder.end_epoch(nn.Linear(2, 3), {**epoch_metrics(0), **figures}, sums["confusion"], improved=False,
                           run_step=1)
    saved = torch.load(tmp_path / "confusion.pt", weights_only=True)
    assert torch.equal(saved["confusion"].long(), sums["confusion"]) and saved["epoch"] == 0
    (picture,) = read_events(tmp_path).Images("confusion_matrix")
    with Image.open(io.BytesIO(picture.encoded_image_string)) as image:
        assert max(image.size) < (MAX_PICTURE_CLASSES + 10) * 44
    assert (tmp_path / "metrics.jsonl").stat().st_size < 10_000


def test_a_real_run_of_many_classes_writes_small_lines(tmp_path: Path) -> None:
    data = make_image_folder(tmp_path / "images", {f"c{index:03d}": 2 for index in range(120)}, size=16)
    out = tmp_path / "run"
    train_single_gpu.main(parse_args("single", ["--data-path", str(data), "--output-dir", str(out), *TINY_FLAGS,
                                                "--batch-size", "16"]))
    (line,) = (out / "metrics.jsonl").read_text().splitlines()
    assert len(line) < 5000 and json.loads(line)["val_total"] == 120
    assert torch.load(out / "confusion.pt", weights_only=True)["confusion"].sum() == 120


def test_a_refused_claim_leaves_the_folder_free_and_names_what_is_in_the_way(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text('{"epoch": 0}\n')  # results without a checkpoint: refused
    with pytest.raises(UserInputError, match="holds the results of a run"):
        claim_folder(tmp_path)
    (tmp_path / "metrics.jsonl").unlink()
    os.mkfifo(tmp_path / "tensorboard")  # neither a file nor a folder, where the run writes a folder
    with pytest.raises(UserInputError, match="tensorboard is a file, where the run writes a folder"):
        claim_folder(tmp_path)
    (tmp_path / "tensorboard").unlink()
    claim_folder(tmp_path).close()  # not "another run is writing there": the refused claims let their lock go


def test_the_disk_check_counts_the_tensors_and_passes_over_a_modules_extra_state(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    class WithExtraState(nn.Linear):
        def get_extra_state(self) -> dict[str, str]:
            return {"note": "not a tensor"}

        def set_extra_state(self, state: object) -> None:
            pass

    model = WithExtraState(1000, 1000)  # 4,004,000 bytes of weights
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # and as many of momentum
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda folder: shutil._ntuple_diskusage(10**9, 0, 10**6))
    checkpoint.warn_if_the_disk_is_short(tmp_path, model, optimizer, epochs_with_weights=1)
    # the checkpoint (weights and momentum), best.pth and one model-N.pth: 4 x 4,004,000 bytes
    assert "the run writes about 15.3 MB" in capsys.readouterr().err


def test_a_folder_deleted_while_the_run_writes_to_it_ends_the_run_in_one_line(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "run"
    gone = r"^cannot write .*/run/tensorboard: its folder .*/run is gone \(deleted"
    with pytest.raises(UserInputError, match=gone), RunRecorder(config_in(folder), single_process("cpu"),
                                                                 SPLIT) as recorder:
        record(recorder, range(1))
        shutil.rmtree(folder)
        record(recorder, range(1, 2))  # TensorBoard's writer thread fails first; its next call says so
    assert "Traceback" not in capfd.readouterr().err  # nor the writer thread's page
