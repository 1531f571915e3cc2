"""Faults for the tests, loaded by every Python process whose PYTHONPATH holds this folder (launchers,
workers and spawned processes alike). Each fault strikes rank <NAME>_RANK, in epoch <NAME>_EPOCH if set:

FAIL  raises at the start of the epoch
HANG  stops answering at the start of the epoch (sleeps)
KILL  SIGKILLs itself after one step, in the first attempt of a torchrun job only
NAN   feeds NaN images at step 1, so its loss becomes NaN
"""

import os

if any(f"{name}_RANK" in os.environ for name in ("FAIL", "HANG", "KILL", "NAN")):
    import signal
    import time

    import multi_train_utils.train_eval_utils as engine
    from multi_train_utils.distributed_utils import get_rank

    def _strikes(name, epoch):
        rank = os.environ.get(f"{name}_RANK")
        return rank is not None and get_rank() == int(rank) and epoch == int(os.environ.get(f"{name}_EPOCH", epoch))

    def _killed_after_one_step(loader):
        for step, batch in enumerate(loader):
            if step == 1:
                os.kill(os.getpid(), signal.SIGKILL)  # no clean-up, as the kernel's OOM killer would do
            yield batch

    def _poisoned(loader):
        for step, (images, labels) in enumerate(loader):
            yield (images * float("nan") if step == 1 else images), labels

    _train_one_epoch = engine.train_one_epoch

    def _faulty_train_one_epoch(model, optimizer, data_loader, device, epoch):
        if _strikes("FAIL", epoch):
            raise RuntimeError(f"failure injected on rank {get_rank()}")
        if _strikes("HANG", epoch):
            time.sleep(600)
        if _strikes("KILL", epoch) and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
            data_loader = _killed_after_one_step(data_loader)
        if _strikes("NAN", epoch):
            data_loader = _poisoned(data_loader)
        return _train_one_epoch(model, optimizer, data_loader, device, epoch)

    engine.train_one_epoch = _faulty_train_one_epoch
