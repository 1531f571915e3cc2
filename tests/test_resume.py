"""Checkpoints: a stopped run continues to the same weights; restarts after a SIGKILL lose nothing."""

from __future__ import annotations

import errno
import json
import shutil
import signal
from pathlib import Path
from typing import BinaryIO

import pytest
import torch

import multi_train_utils.train_eval_utils as engine
import train_single_gpu
import utils
from conftest import (
    REPO,
    TINY_FLAGS,
    checkpointer,
    make_image_folder,
    run,
    run_single_in_this_process,
    script_env,
    torchrun,
    write_image,
)
from multi_train_utils import checkpoint, errors, files, recorder
from multi_train_utils.cli import parse_args
from multi_train_utils.errors import UserInputError

RESUME_FLAGS = [*TINY_FLAGS, "--epochs", "3", "--lr", "0.002", "--batch-size", "8"]


class Stop(Exception):
    """Stands in for anything that ends a run between two epochs."""


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_image_folder(tmp_path_factory.mktemp("resume") / "images", {"red": 12, "green": 12, "blue": 12})


def train(data: Path, out: Path, *extra: str) -> None:
    train_single_gpu.main(parse_args("single", ["--data-path", str(data), "--output-dir", str(out),
                                                *RESUME_FLAGS, *extra]))


def max_difference(a: Path, b: Path) -> float:
    first, second = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    assert first.keys() == second.keys()
    return max((first[k].double() - second[k].double()).abs().max().item() for k in first)


def test_a_run_stopped_after_an_epoch_and_resumed_ends_with_the_same_weights(
        data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    train(data, tmp_path / "unbroken")

    original = engine.train_one_epoch

    def stop_at_epoch_2(*args: object, **kwargs: object) -> float:
        if kwargs.get("epoch", args[5] if len(args) > 5 else None) == 2:
            raise Stop
        return original(*args, **kwargs)

    monkeypatch.setattr(engine, "train_one_epoch", stop_at_epoch_2)
    with pytest.raises(Stop):
        train(data, tmp_path / "broken")
    assert torch.load(tmp_path / "broken" / "checkpoint.pth", weights_only=True)["epoch"] == 1
    monkeypatch.setattr(engine, "train_one_epoch", original)
    train(data, tmp_path / "broken", "--resume", "auto")

    assert max_difference(tmp_path / "unbroken" / "weights" / "model-2.pth",
                          tmp_path / "broken" / "weights" / "model-2.pth") <= 1e-6
    lines = [json.loads(line) for line in (tmp_path / "broken" / "metrics.jsonl").read_text().splitlines()]
    assert [m["epoch"] for m in lines] == [0, 1, 2]
    capsys.readouterr()
    train(data, tmp_path / "broken", "--resume", "auto")  # once more: the run has finished
    assert "Nothing to train: 3 epoch(s) trained already; a larger --epochs than 3 goes on" in capsys.readouterr().out


def test_a_fresh_run_refuses_to_overwrite_a_run(data: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    train(data, out, "--epochs", "1")
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    result = run_single_in_this_process(["--data-path", str(data), "--output-dir", str(out), *RESUME_FLAGS])
    assert result.returncode == 2
    assert result.stderr.strip() == (f"error: --output-dir {out}: holds a run already ({out / 'checkpoint.pth'}); "
                                     "continue it with --resume auto, or choose another --output-dir")
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


@pytest.mark.parametrize("mismatch", ["model", "model of a checkpoint without its flags", "classes"])
def test_a_checkpoint_of_another_model_or_class_count_is_a_clear_error(data: Path, tmp_path: Path,
                                                                       mismatch: str) -> None:
    train(data, tmp_path / "first", "--epochs", "1")
    saved = tmp_path / "first" / "checkpoint.pth"
    if mismatch.endswith("without its flags"):  # an older or hand-made layout: only the weights can tell
        torch.save({key: value for key, value in torch.load(saved, weights_only=True).items() if key != "args"},
                   saved)
    other_data = make_image_folder(tmp_path / "two_classes", {"a": 10, "b": 10})
    flags = (["--model", "resnet34", "--data-path", str(data)] if mismatch.startswith("model")
             else ["--data-path", str(other_data)])
    result = run_single_in_this_process(["--output-dir", str(tmp_path / "second"), *RESUME_FLAGS, *flags,
                                         "--resume", str(saved)])
    assert result.returncode == 2
    expected = {"model": "error: --model resnet34: the run trained with --model resnet18, and a run keeps it",
                "classes": f"error: --data-path {other_data}: the classes differ from the run's"
                }.get(mismatch, f"error: --resume {saved}: saved from another model, or for other classes, than "
                                "--model resnet34 here")
    assert result.stderr.startswith(expected), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    if mismatch.endswith("without its flags"):  # which tensors do not fit, not PyTorch's page of them
        assert "tensor(s) missing, such as" in result.stderr and "Error(s)" not in result.stderr
    else:  # refused before anything is written
        assert not (tmp_path / "second").exists()


def test_a_weights_file_is_not_a_checkpoint(tmp_path: Path) -> None:
    torch.save({"conv.weight": torch.zeros(1)}, tmp_path / "plain.pth")
    with pytest.raises(UserInputError, match=r"not a checkpoint of this project .*--weights instead"):
        recorder.read_checkpoint(tmp_path / "plain.pth")
    with pytest.raises(UserInputError, match=r"--resume .*nothing\.pth: no such file"):
        recorder.read_checkpoint(recorder.checkpoint_to_resume(str(tmp_path / "nothing.pth"), tmp_path))
    assert recorder.checkpoint_to_resume("auto", tmp_path / "empty") is None


def test_a_restarted_attempt_continues_from_the_newest_checkpoint(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "start.pth").write_bytes(b"the checkpoint the job was started from")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert recorder.checkpoint_to_resume(None, tmp_path) is None  # died before its first checkpoint
    assert recorder.checkpoint_to_resume(str(tmp_path / "start.pth"), tmp_path) == tmp_path / "start.pth"
    (tmp_path / "checkpoint.pth").write_bytes(b"written by the attempt that died")
    assert recorder.checkpoint_to_resume(None, tmp_path) == tmp_path / "checkpoint.pth"
    assert recorder.checkpoint_to_resume(str(tmp_path / "start.pth"), tmp_path) == tmp_path / "checkpoint.pth"
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    with pytest.raises(UserInputError, match="holds a run already"):
        recorder.checkpoint_to_resume(None, tmp_path)


def test_resuming_on_another_world_size_follows_the_lr_of_its_batch(data: Path, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from model import create_model
    from multi_train_utils.optim import StepOptions, build_optimizer

    train(data, tmp_path / "run", "--epochs", "2")  # one process, lr 0.002
    (tmp_path / "run" / "metrics.jsonl").open("a").write('{"epoch": 2, "train_lo')  # what a kill mid-write leaves
    saved = recorder.find_saved_run("auto", tmp_path / "run")
    saved_lr = saved.state["optimizer"]["param_groups"][0]["lr"]
    model = create_model("resnet18", 3)
    monkeypatch.setattr(checkpoint, "get_world_size", lambda: 4)
    with checkpointer(model, build_optimizer(model, lr=0.002 * 4), tmp_path / "four") as four:
        assert four.resume(saved) == 2 and four.best.value == pytest.approx(saved.state["best"]["value"])
        four.on_epoch_start(2)  # both schedules are at their end
    assert four.optimizer.param_groups[0]["lr"] == pytest.approx(4 * saved_lr)
    assert four.scheduler.base_lrs == [pytest.approx(0.008)] * 2
    # The same for a larger optimizer step made of accumulated batches: 2 processes x 3 batches = 6 x 0.002.
    monkeypatch.setattr(checkpoint, "get_world_size", lambda: 2)
    with checkpointer(model, build_optimizer(model, lr=0.002 * 6), tmp_path / "two", StepOptions(accum_steps=3)) as two:
        two.resume(saved)
        two.on_epoch_start(2)
    step = 2 * two.steps_per_epoch
    assert two.optimizer.param_groups[0]["lr"] == pytest.approx(0.012 * two.scheduler.lr_lambdas[0](step))
    assert two.scheduler.base_lrs == [pytest.approx(0.012)] * 2
    monkeypatch.undo()
    train(data, tmp_path / "run", "--epochs", "3", "--resume", "auto")  # the torn line is dropped, not a crash
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["epoch"] for line in lines] == [0, 1, 2]


def test_an_interrupted_checkpoint_write_leaves_the_previous_one_whole(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "checkpoint.pth"
    files.save_atomic({"epoch": 1, "weights": torch.ones(1000)}, path)

    def dies_half_way(obj: object, target: BinaryIO) -> None:
        target.write(b"PK\x03\x04 the first bytes")  # what a crash mid-write leaves
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", dies_half_way)
    with pytest.raises(KeyboardInterrupt):
        files.save_atomic({"epoch": 2, "weights": torch.zeros(1000)}, path)
    assert torch.load(path, weights_only=True)["epoch"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.pth"], "no temporary file left behind"


@pytest.mark.parametrize(("signum", "stop"), [(signal.SIGINT, KeyboardInterrupt), (signal.SIGTERM, errors.Terminated)])
def test_a_stop_during_a_write_comes_once_the_file_is_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            signum: int, stop: type[BaseException]) -> None:
    """Raised inside torch.save's writer, the stop would be lost there ("unexpected pos"), and a Ctrl-C during
    the checkpoint would end the run as a disk that cannot be written."""
    path = tmp_path / "checkpoint.pth"
    real_save = torch.save

    def signalled_half_way(obj: object, target: BinaryIO) -> None:
        signal.raise_signal(signum)
        real_save(obj, target)

    errors.listen_for_stop_signals()
    monkeypatch.setattr(torch, "save", signalled_half_way)
    with pytest.raises(stop):
        files.save_atomic({"epoch": 2}, path)
    assert torch.load(path, weights_only=True)["epoch"] == 2


@pytest.mark.parametrize("failure", [OSError(errno.ENOSPC, "No space left on device"),
                                     RuntimeError("basic_ios::clear: iostream error")])
def test_a_full_disk_is_one_line_naming_the_file_and_leaves_nothing_half_written(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failure: Exception) -> None:
    path = tmp_path / "checkpoint.pth"
    files.save_atomic({"epoch": 1}, path)

    def disk_full(obj: object, target: BinaryIO) -> None:
        target.write(b"as much as fitted")
        raise failure

    monkeypatch.setattr(torch, "save", disk_full)
    monkeypatch.setattr(files.shutil, "disk_usage", lambda folder: shutil._ntuple_diskusage(10**9, 10**9, 0))
    with pytest.raises(UserInputError, match=f"^cannot write {path}: the disk is full") as refused:
        files.save_atomic({"epoch": 2, "weights": torch.zeros(2**18)}, path)
    assert "the file needs about 1.0 MB, 0.0 MB free" in str(refused.value), "what the write needed, and what is left"
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.pth"]
    assert torch.load(path, weights_only=True)["epoch"] == 1


def test_two_writers_of_one_file_never_share_a_temporary_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two runs saving into one output folder at the same moment: with one fixed temporary name, the second
    would replace the first one's half-written file, and the first one's rename would find nothing."""
    path = tmp_path / "checkpoint.pth"
    real_save = torch.save

    def save_while_another_run_saves(obj: dict, target: BinaryIO) -> None:
        if obj["run"] == "first":
            files.save_atomic({"run": "second"}, path)
        real_save(obj, target)

    monkeypatch.setattr(torch, "save", save_while_another_run_saves)
    files.save_atomic({"run": "first"}, path)
    assert torch.load(path, weights_only=True) == {"run": "first"}
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.pth"]


def test_rng_states_round_trip_through_a_weights_only_file(tmp_path: Path) -> None:
    import random

    import numpy as np

    torch.manual_seed(3), random.seed(3), np.random.seed(3)
    torch.save(checkpoint.rng_state(), tmp_path / "rng.pth")
    expected = (torch.rand(3), random.random(), np.random.rand())
    checkpoint.set_rng_state(torch.load(tmp_path / "rng.pth", weights_only=True))
    assert torch.equal(torch.rand(3), expected[0])
    assert (random.random(), np.random.rand()) == expected[1:]


@pytest.mark.slow
@pytest.mark.schedulers  # torchrun's elastic agent restarting the job
def test_torchrun_restart_after_a_sigkilled_rank_ends_with_the_same_weights(data: Path, tmp_path: Path) -> None:
    """With a checkpoint after every step, the restarted attempt goes on from the step before the kill."""
    cmd = [*torchrun(), "--standalone", "--nproc_per_node=2", "--max-restarts=1",
           str(REPO / "train_multi_gpu_using_launch.py"), "--data-path", str(data), *RESUME_FLAGS, "--epochs", "2",
           "--batch-size", "4", "--checkpoint-every-steps", "1"]  # 3 steps per epoch and process
    unbroken = run([*cmd, "--output-dir", str(tmp_path / "unbroken")])
    assert unbroken.returncode == 0, unbroken.stderr[-3000:]
    env = script_env(KILL_RANK="1", KILL_EPOCH="1", PYTHONPATH=f"{REPO / 'tests' / 'fault_injection'}:{REPO}")
    broken = run([*cmd, "--output-dir", str(tmp_path / "broken")], env=env)
    assert broken.returncode == 0, broken.stderr[-3000:]
    # Killed as it took batch 1 of epoch 1, after the checkpoint of step 1.
    assert f"Resuming from {tmp_path / 'broken' / 'checkpoint.pth'} at epoch 1, step 1" in broken.stdout
    assert max_difference(tmp_path / "unbroken" / "weights" / "model-1.pth",
                          tmp_path / "broken" / "weights" / "model-1.pth") <= 1e-6
    lines = [json.loads(line) for line in (tmp_path / "broken" / "metrics.jsonl").read_text().splitlines()]
    assert [m["epoch"] for m in lines] == [0, 1]


def test_a_resume_keeps_the_runs_classes_and_split_whatever_happened_to_the_folder(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A class folder renamed would re-map every class index; images deleted would re-draw the whole split
    and validate on images the model trained on. The run keeps what it started with, or stops."""
    data = make_image_folder(tmp_path / "images", {"red": 10, "green": 10, "blue": 10})
    out = tmp_path / "run"
    train(data, out, "--epochs", "1")
    started = json.loads((out / "split.json").read_text())
    record = torch.load(out / "checkpoint.pth", weights_only=True)["split"]
    assert started["class_names"] == record["class_names"] == ["blue", "green", "red"] and len(started["train"]) == 24
    assert (record["train_count"], record["val_count"]) == (24, 6), "the checkpoint keeps counts and a digest"

    (data / started["train"][0]).unlink()
    (data / started["val"][0]).unlink()
    write_image(data / "red" / "new_photo.jpg", (220, 40, 40))
    capsys.readouterr()
    train(data, out, "--epochs", "2", "--resume", "auto")
    assert "2 image(s) of the run's split are gone; 1 new image(s) are left out" in capsys.readouterr().out
    kept = json.loads((out / "split.json").read_text())
    assert kept["train"] == started["train"][1:] and kept["val"] == started["val"][1:]

    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    (data / "red").rename(data / "crimson")
    with pytest.raises(UserInputError, match=r"the classes differ from the run's \(gone: red; new: crimson\)"):
        train(data, out, "--epochs", "3", "--resume", "auto")
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before, "nothing written is lost"


def test_a_run_on_train_and_val_folders_resumes_on_its_split_from_one_listing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """ImageNet's layout: a resumed run finds its split in train/ and val/ again, each class folder listed once
    (a second listing of ImageNet takes seconds); after files changed it keeps its own, val/ still apart."""
    data = tmp_path / "imagenet"
    make_image_folder(data / "train", {"n01": 6, "n02": 6})
    make_image_folder(data / "val", {"n01": 2, "n02": 2})
    out = tmp_path / "run"
    train(data, out, "--epochs", "1")
    started = json.loads((out / "split.json").read_text())
    listed, list_images = [], utils.list_images
    monkeypatch.setattr(utils, "list_images", lambda folder, *rest: listed.append(str(folder))
                        or list_images(folder, *rest))
    train(data, out, "--epochs", "2", "--resume", "auto")
    assert sorted(listed) == [str(data / side / name) for side in ("train", "val") for name in ("n01", "n02")]
    assert json.loads((out / "split.json").read_text()) == started

    (data / started["val"][0]).unlink()
    write_image(data / "train" / "n01" / "new_photo.jpg", (220, 40, 40))
    capsys.readouterr()
    train(data, out, "--epochs", "3", "--resume", "auto")
    assert "1 image(s) of the run's split are gone; 1 new image(s) are left out" in capsys.readouterr().out
    kept = json.loads((out / "split.json").read_text())
    assert kept["train"] == started["train"] and kept["val"] == started["val"][1:]
    assert all(path.startswith("val/") for path in kept["val"])


def test_a_checkpoint_cut_short_names_the_newest_older_one_that_loads(data: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    train(data, out, "--epochs", "2", "--keep-checkpoints", "3")
    older = out / "checkpoints" / "epoch-0-end.pth"
    assert older.is_file()
    whole = (out / "checkpoint.pth").read_bytes()
    (out / "checkpoint.pth").write_bytes(whole[: len(whole) // 2])  # what a full disk or a broken copy leaves
    with pytest.raises(UserInputError) as caught:
        recorder.find_saved_run("auto", out)
    assert str(caught.value) == (f"--resume {out / 'checkpoint.pth'}: not a PyTorch file (damaged, cut short, or "
                                 f"another kind of file); the newest older checkpoint that loads is {older}: go on "
                                 f"from it with --resume {older}")
    train(data, out, "--epochs", "2", "--resume", str(older))
    assert [json.loads(line)["epoch"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [0, 1]
