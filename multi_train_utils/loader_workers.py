"""The data-loader worker processes: how many, how they start, and which signals they obey."""

from __future__ import annotations

import multiprocessing.context
import os
import signal
import sys
import threading

from .distributed_utils import DistContext
from .launch import usable_cpus
from .shutdown import STOP_SIGNALS

# Enough workers for what one current GPU trains ResNet-34 on at 224 px (3,000-5,000 images/s, at about
# 500 images/s per worker); more only hold memory and take longer to start.
MAX_GPU_WORKERS = 16
# Ctrl-C and the schedulers' signals: the training process ends its workers itself.
SIGNALS_LEFT_TO_THE_TRAINER = (signal.SIGINT, *STOP_SIGNALS)


def default_workers(ctx: DistContext) -> int:
    """Data-loader processes per training process: this process's share of the usable CPUs, less one for
    the training process itself, which feeds the GPU.

    On a CPU the training itself wants every core, so the loaders get only what is left over.
    """
    per_process = max(1, usable_cpus() // ctx.local_world_size)
    if ctx.device.type == "cuda":
        return max(1, min(MAX_GPU_WORKERS, per_process - 1))
    return min(4, per_process // 4)


def loader_start_method(workers: int) -> multiprocessing.context.BaseContext | None:
    """Fork data-loader workers on Linux, even inside processes started by spawn (whose children would
    otherwise be spawned too, each importing torch again: seconds per worker)."""
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
