"""Faults for the tests, loaded by every Python process whose PYTHONPATH holds this folder (launchers,
workers and spawned processes alike). Each fault strikes rank <NAME>_RANK, in epoch <NAME>_EPOCH if set:

FAIL  raises at the start of the epoch, naming the moment (time.time())
HANG  stops answering at the start of the epoch (sleeps)
KILL  SIGKILLs itself after one step (under torchrun, in the first attempt of the job only)
NAN   feeds NaN images at step 1, so its loss becomes NaN
SIGNAL sends signal SIGNAL_NAME (TERM, USR1) when it takes batch SIGNAL_STEP (default 1), to its launcher
      if SIGNAL_TO is "launcher", else to itself: a scheduler's stop, arriving in the middle of an epoch

RECORD_SAMPLES (a folder; no rank needed) logs the path of every image each process loads, in order, to
<world size>-<rank>-<pid> there.
"""

import os

if any(f"{name}_RANK" in os.environ for name in ("FAIL", "HANG", "KILL", "NAN", "SIGNAL")):
    import signal
    import time

    import multi_train_utils.train_eval_utils as engine
    from multi_train_utils.distributed_utils import get_rank

    def _strikes(name, epoch):
        rank = os.environ.get(f"{name}_RANK")
        return rank is not None and get_rank() == int(rank) and epoch == int(os.environ.get(f"{name}_EPOCH", epoch))

    class _Altered:
        """The loader's batches through `alter(step, batch)`, with the loader's length (the loop reads it)."""

        def __init__(self, loader, alter):
            self.loader, self.alter = loader, alter

        def __len__(self):
            return len(self.loader)

        def __iter__(self):
            return (self.alter(step, batch) for step, batch in enumerate(self.loader))

    def _kill_at_step_1(step, batch):
        if step == 1:
            os.kill(os.getpid(), signal.SIGKILL)  # no clean-up, as the kernel's OOM killer would do
        return batch

    def _nan_at_step_1(step, batch):
        images, labels = batch
        return (images * float("nan") if step == 1 else images), labels

    def _signal_at_step(step, batch):
        if step == int(os.environ.get("SIGNAL_STEP", 1)):
            target = os.getppid() if os.environ.get("SIGNAL_TO") == "launcher" else os.getpid()
            os.kill(target, getattr(signal, f"SIG{os.environ['SIGNAL_NAME']}"))
        return batch

    _train_one_epoch = engine.train_one_epoch

    def _faulty_train_one_epoch(model, criterion, optimizer, data_loader, device, epoch, *rest):
        if _strikes("FAIL", epoch):
            raise RuntimeError(f"failure injected on rank {get_rank()} at {time.time():.3f}")
        if _strikes("HANG", epoch):
            time.sleep(600)
        if _strikes("KILL", epoch) and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
            data_loader = _Altered(data_loader, _kill_at_step_1)
        if _strikes("NAN", epoch):
            data_loader = _Altered(data_loader, _nan_at_step_1)
        if _strikes("SIGNAL", epoch) and not os.path.exists(os.environ["SIGNAL_ONCE_FILE"]):
            open(os.environ["SIGNAL_ONCE_FILE"], "w").close()  # not again in the resumed run
            data_loader = _Altered(data_loader, _signal_at_step)
        return _train_one_epoch(model, criterion, optimizer, data_loader, device, epoch, *rest)

    engine.train_one_epoch = _faulty_train_one_epoch

if "RECORD_SAMPLES" in os.environ:
    import my_dataset
    from multi_train_utils.distributed_utils import get_rank, get_world_size

    _getitem = my_dataset.MyDataSet.__getitem__

    def _recorded_getitem(self, index):
        log = os.path.join(os.environ["RECORD_SAMPLES"], f"{get_world_size()}-{get_rank()}-{os.getpid()}")
        with open(log, "a") as file:
            file.write(self.images_path[index] + "\n")
        return _getitem(self, index)

    my_dataset.MyDataSet.__getitem__ = _recorded_getitem
