"""A training sampler of one's own (build_loaders' `sampler`): what exact resume needs of it, and what a resume
says when it cannot be exact or the sampler changed."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from conftest import checkpointer
from multi_train_utils.data import ResumableDistributedSampler, SkippingSampler, build_loaders
from multi_train_utils.distributed_utils import DistContext
from multi_train_utils.recorder import SavedRun


class OddFirst(DistributedSampler):
    """A plain DistributedSampler subclass, without skip(): the odd indices of each epoch's permutation first."""

    def __init__(self, dataset: TensorDataset, num_replicas: int, rank: int, seed: int = 0) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, seed=seed, drop_last=True)

    def __iter__(self) -> Iterator[int]:
        order = torch.randperm(len(self.dataset), generator=torch.Generator().manual_seed(self.seed + self.epoch))
        order = torch.cat([order[order % 2 == 1], order[order % 2 == 0]])[:self.total_size]
        return iter(order[self.rank:self.total_size:self.num_replicas].tolist())


def images(count: int) -> TensorDataset:
    return TensorDataset(torch.rand(count, 3, 4, 4), torch.arange(count) % 3)


def context(rank: int, world_size: int) -> DistContext:
    return DistContext(rank, rank, world_size, world_size, torch.device("cpu"), distributed=world_size > 1)


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_sampler_without_skip_goes_on_inside_an_epoch_with_the_samples_left(world_size: int) -> None:
    for rank in range(world_size):
        train, _ = build_loaders(images(22), images(4), 2, context(rank, world_size), workers=0, seed=5,
                                 sampler=OddFirst)
        assert isinstance(train.sampler, SkippingSampler) and train.sampler.dataset is train.dataset
        train.sampler.set_epoch(3)
        whole = list(train.sampler)
        assert train.sampler.epoch_length == len(whole) == 22 // world_size
        train.sampler.skip(6)  # 6 samples of all processes trained before the stop
        assert train.sampler.skipped == 6 // world_size and list(train.sampler) == whole[6 // world_size:]
        assert len(train) == (len(whole) - 6 // world_size) // 2
        train.sampler.set_epoch(4)  # the next epoch starts whole again
        assert train.sampler.skipped == 0 and len(list(train.sampler)) == len(whole)


def test_the_projects_own_sampler_is_used_as_it_is() -> None:
    train, _ = build_loaders(images(8), images(4), 2, context(0, 1), workers=0)
    assert type(train.sampler) is ResumableDistributedSampler


def saved_run(folder: Path, loader: DataLoader, world_size: int = 1) -> SavedRun:
    model = nn.Linear(2, 2)
    with checkpointer(model, torch.optim.SGD(model.parameters(), lr=0.1), folder, loader=loader) as saver:
        state = saver.build(0)
    state["progress"] = {"epoch": 1, "step": 1, "samples_seen": 2, "loss_sum": 1.0}
    state["rng"] = state["rng"] * world_size
    return SavedRun(str(folder / "checkpoint.pth"), state)


def loader_of(sampler: type) -> DataLoader:
    train, _ = build_loaders(images(8), images(4), 2, context(0, 1), workers=0, sampler=sampler)
    return train


def test_a_checkpoint_records_its_sampler_and_a_resume_with_another_says_so(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    saved = saved_run(tmp_path / "odd", loader_of(OddFirst))
    assert saved.state["sampler"] == "OddFirst"
    model = nn.Linear(2, 2)
    with checkpointer(model, torch.optim.SGD(model.parameters(), lr=0.1), tmp_path / "plain",
                      loader=loader_of(ResumableDistributedSampler)) as resumed:
        resumed.resume(saved)
    assert "Changed on resume, applied from here on and kept in the checkpoints: the training sampler OddFirst -> " \
           "ResumableDistributedSampler" in capsys.readouterr().out


def test_resuming_a_sampler_without_skip_inside_an_epoch_on_other_processes_says_what_it_cannot_do(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    saved = saved_run(tmp_path / "two", loader_of(OddFirst), world_size=2)
    model = nn.Linear(2, 2)
    with checkpointer(model, torch.optim.SGD(model.parameters(), lr=0.1), tmp_path / "one",
                      loader=loader_of(OddFirst)) as resumed:
        resumed.resume(saved)
    out = capsys.readouterr().out
    assert "Resuming inside an epoch with 1 processes instead of 2: the training sampler OddFirst has no skip() of " \
           "its own (data.py), so each process leaves out its share of the samples trained" in out
    assert "Changed on resume" not in out
