"""Data loaders that give each process its own share of the data: the samplers, the loaders, and the loader's
worker processes (how many, how they start, which signals they obey).

The datasets themselves come from the scripts (my_dataset.py, utils.py, or your own): any map-style dataset
of (image, label) pairs, where an image is a uint8 tensor (3, H, W), or a float tensor the model takes as it is.
A dataset may bring its own `collate_fn`, as the tutorial's MyDataSet does.

Training deals each epoch's permutation of the training set, drawn from (seed, epoch) as DistributedSampler draws
it, round-robin (rank r takes r, r+N, r+2N, ...), also with one process, so that the order depends only on the
seed and the epoch; drop_last: the fewer than N samples that do not divide among the N processes wait for the next
epoch instead of being repeated. After any number of batches the processes together have taken the permutation's
first samples, so an epoch resumed after `skip(samples_seen)`, by however many processes, deals out exactly the
samples that are left.

A training sampler of your own is build_loaders' `sampler`, called as sampler(dataset, num_replicas, rank, seed)
(a DistributedSampler subclass is one); it deals this process's indices of an epoch after set_epoch(epoch). To go
on inside an epoch, a resume needs three more things of it: `skip(samples_seen)` (start this epoch after the first
samples_seen of all processes' samples), `skipped` (this process's share of them) and `epoch_length` (this
process's share of a whole epoch). One without them is wrapped in SkippingSampler, which leaves out this
process's first samples_seen // num_replicas indices: exact where the sampler's order comes from its seed and
the epoch alone (as DistributedSampler's does) and the run resumes on as many processes; on another number, a
resume says so in one line. Validation deals without padding: DistributedSampler pads every rank to the same length by
repeating samples (11 samples on 2 ranks become 12), which would count the repeated images twice; here ranks may
get one sample less, so correct/total summed over ranks is exact.

The loader's workers are forked on Linux, even inside processes started by spawn (whose children would otherwise
be spawned too, each importing torch again: seconds per worker), with Ctrl-C and the stop signals blocked, which
they then leave to the training process (leave_signals_to_the_trainer). Persistent workers left to the garbage
collector would end only after 5 s each (torch's MP_STATUS_CHECK_INTERVAL): the collector closes the loader's
queues before the loader sends its workers the word to stop, and each worker waits out its timeout; ended by
`workers_ended`, while the queues are open, they go in a fraction of a second.
"""

from __future__ import annotations

import itertools
import multiprocessing.context
import os
import random
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sized
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from .distributed_utils import DistContext, print_main
from .errors import STOP_SIGNALS, UserInputError
from .launch import cpu_share

# Matched without regard to case; the last two are what Windows' browsers save. utils.IMAGE_EXTENSIONS starts with
# them, and --decode-on gpu decodes these on the GPU.
JPEG_SUFFIXES = (".jpg", ".jpeg", ".jfif", ".jpe")


def seed_everything(seed: int, rank: int = 0) -> None:
    """Seed Python, NumPy and torch; each rank gets its own stream so augmentations differ across ranks."""
    random.seed(seed + rank)
    np.random.seed(seed + rank)
    torch.manual_seed(seed + rank)


class ResumableDistributedSampler(DistributedSampler):
    """DistributedSampler (shuffled, drop_last), which can also start an epoch part-way (see the module's docstring)."""

    def __init__(self, dataset: Sized, num_replicas: int, rank: int, seed: int = 0) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed, drop_last=True)
        self.epoch_length = len(dataset) // num_replicas  # this process's share, what is skipped included
        self.skip(0)

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        self.skip(0)

    def skip(self, samples_seen: int) -> None:
        """Start this epoch after the first `samples_seen` samples of its permutation (all processes' together)."""
        self.samples_seen = samples_seen

    @property
    def skipped(self) -> int:  # this process's share of the samples skipped
        return self.samples_seen // self.num_replicas

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        left = torch.randperm(len(self.dataset), generator=generator)[self.samples_seen:].tolist()
        return iter(left[self.rank:len(self) * self.num_replicas:self.num_replicas])

    def __len__(self) -> int:
        return max(0, len(self.dataset) - self.samples_seen) // self.num_replicas


# (dataset, num_replicas, rank, seed) -> this process's training sampler (see the module's docstring)
SamplerFactory = Callable[[Dataset, int, int, int], Sampler[int]]


class SkippingSampler(Sampler[int]):
    """A training sampler without skip() of its own, made to go on inside an epoch: it leaves out this process's
    first samples_seen // num_replicas indices of the epoch (see the module's docstring)."""

    def __init__(self, sampler: Sampler[int]) -> None:
        self.sampler, self.num_replicas = sampler, getattr(sampler, "num_replicas", 1)
        self.skip(0)

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)
        self.skip(0)

    def skip(self, samples_seen: int) -> None:
        self.samples_seen = samples_seen

    @property
    def skipped(self) -> int:
        return self.samples_seen // self.num_replicas

    @property
    def epoch_length(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[int]:
        return itertools.islice(iter(self.sampler), self.skipped, None)

    def __len__(self) -> int:
        return max(0, len(self.sampler) - self.skipped)

    def __getattr__(self, name: str) -> Any:  # the sampler's own attributes, as if unwrapped
        if name == "sampler":
            raise AttributeError(name)
        return getattr(self.sampler, name)


def resumable(sampler: Sampler[int]) -> Sampler[int]:
    """`sampler` itself where it can skip what a resumed epoch trained already, else wrapped so that it can."""
    return sampler if all(hasattr(sampler, name) for name in ("skip", "skipped", "epoch_length")) else \
        SkippingSampler(sampler)


def sampler_name(sampler: Sampler[int]) -> str:
    """The class of a training sampler, unwrapped: what a checkpoint records of it."""
    return type(sampler.sampler if isinstance(sampler, SkippingSampler) else sampler).__qualname__


class UnpaddedDistributedSampler(Sampler[int]):
    """Deal indices round-robin (rank r gets r, r+N, r+2N, ...) without padding (see the module's docstring)."""

    def __init__(self, dataset_size: int, num_replicas: int, rank: int) -> None:
        self.dataset_size, self.num_replicas, self.rank = dataset_size, num_replicas, rank

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.rank, self.dataset_size, self.num_replicas))

    def __len__(self) -> int:
        return len(range(self.rank, self.dataset_size, self.num_replicas))


def build_loaders(train_set: Dataset, val_set: Dataset, batch_size: int, ctx: DistContext,
                  workers: int | None = None, seed: int = 0,
                  sampler: SamplerFactory = ResumableDistributedSampler) -> tuple[DataLoader, DataLoader]:
    """Training and validation loaders for this process's share of the data; `sampler` deals the training images
    (see the module's docstring for one of your own)."""
    common = loader_options(len(train_set), batch_size, ctx, workers, seed)
    # drop_last: a last batch of one image breaks BatchNorm, and equal batches keep ranks in step.
    train_loader = DataLoader(train_set, sampler=resumable(sampler(train_set, ctx.world_size, ctx.rank, seed)),
                              drop_last=True, collate_fn=getattr(train_set, "collate_fn", None), **common)
    val_loader = DataLoader(val_set, sampler=UnpaddedDistributedSampler(len(val_set), ctx.world_size, ctx.rank),
                            collate_fn=getattr(val_set, "collate_fn", None), **common)
    return train_loader, val_loader


def loader_options(train_images: int, batch_size: int, ctx: DistContext, workers: int | None,
                   seed: int) -> dict[str, Any]:
    """What both loaders share: the batch (no larger than each process's share of the `train_images`), the worker
    processes (default_workers unless --workers says), and the seed of the loader's own random numbers."""
    per_process = train_images // ctx.world_size
    if per_process < batch_size:
        raise UserInputError(f"--batch-size {batch_size}: larger than the {per_process} training images "
                             f"each of the {ctx.world_size} process(es) gets")
    workers = default_workers(ctx) if workers is None else workers
    print_main(f"Using {workers} data-loader workers per process")
    return dict(batch_size=batch_size, num_workers=workers, pin_memory=ctx.device.type == "cuda",
                persistent_workers=workers > 0, multiprocessing_context=loader_start_method(workers),
                worker_init_fn=leave_signals_to_the_trainer,
                # The loader's own seeds come from here, not from the random numbers the augmentations
                # draw: a run resumed inside an epoch then draws the same augmentations as an unbroken one.
                generator=torch.Generator().manual_seed(seed + ctx.rank))


@contextmanager
def workers_ended(*loaders: DataLoader) -> Iterator[None]:
    """End the loaders' worker processes when the block ends, however it ends, and at once."""
    try:
        yield
    finally:
        for loader in loaders:
            # No public call for it: `_iterator` holds persistent workers (iterated again, the loader starts anew)
            iterator, loader._iterator = getattr(loader, "_iterator", None), None
            if hasattr(iterator, "_shutdown_workers"):
                iterator._shutdown_workers()


# Enough workers for what one current GPU trains ResNet-34 on at 224 px (3,000-5,000 images/s, at about
# 500 images/s per worker); more only hold memory and take longer to start.
MAX_GPU_WORKERS = 16
# Ctrl-C and the schedulers' signals: the training process ends its workers itself.
SIGNALS_LEFT_TO_THE_TRAINER = (signal.SIGINT, *STOP_SIGNALS)


def default_workers(ctx: DistContext) -> int:
    """Data-loader processes per training process: its share of the usable CPUs, less one for itself."""
    per_process = cpu_share(ctx.local_world_size)
    if ctx.device.type == "cuda":  # one CPU left to the training process, which feeds the GPU
        return max(1, min(MAX_GPU_WORKERS, per_process - 1))
    return min(4, per_process // 4)  # on a CPU training wants every core: the loaders get what is left over


def loader_start_method(workers: int) -> multiprocessing.context.BaseContext | None:
    """Fork data-loader workers on Linux (see the module's docstring), with the stop signals blocked."""
    return WorkerForkContext() if workers > 0 and sys.platform == "linux" else None


if sys.platform != "win32":  # fork (and so this) exists on POSIX systems only
    class WorkerForkContext(multiprocessing.context.ForkContext):
        """Forks data-loader workers with Ctrl-C and the stop signals blocked: every thread of a worker, also
        those started before its worker_init_fn runs, then leaves them to the one thread that sorts them
        (leave_signals_to_the_trainer); a Ctrl-C that comes meanwhile waits, and is then ignored."""

        class Process(multiprocessing.context.ForkProcess):
            def start(self) -> None:
                # In the training process only for the moment of the fork: a signal meanwhile waits, then
                # arrives.
                previous = signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS_LEFT_TO_THE_TRAINER)
                try:
                    super().start()
                finally:
                    signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def leave_signals_to_the_trainer(worker_id: int) -> None:
    """In a data-loader worker: ignore Ctrl-C, and stop signals sent by anyone but the training process.

    Ctrl-C reaches every process of the terminal's group, the workers too, each of which would print a
    KeyboardInterrupt traceback. Schedulers signal every process of a job (SLURM the whole job step,
    torchrun the process group): a worker that died of it would fail the training process at its next
    batch, before that process could reach the step where every rank stops and saves. The training
    process itself still ends its workers with SIGTERM when it is done with them.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if not hasattr(signal, "sigwaitinfo"):  # macOS, Windows: the stop signals act as usual
        return
    trainer = os.getppid()
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)  # already, if WorkerForkContext started it
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])  # ignored now, also if it came meanwhile

    def sort_signals() -> None:
        while True:
            info = signal.sigwaitinfo(STOP_SIGNALS)
            if info.si_signo == signal.SIGTERM and info.si_pid == trainer:
                # As after the loader's own shut-down: a code other than 0 would make the loader, which
                # still watches its workers while Python exits, report the worker as failed.
                os._exit(0)

    threading.Thread(target=sort_signals, name="stop-signals", daemon=True).start()
