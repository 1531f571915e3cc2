"""Loaded by every Python process whose PYTHONPATH holds this folder (launchers, workers, spawned
processes alike): when FAIL_RANK is set, training raises on that rank, to test that one failing rank
ends the whole job."""

import os

if "FAIL_RANK" in os.environ:
    import multi_train_utils.train_eval_utils as engine
    from multi_train_utils.distributed_utils import get_rank

    _train_one_epoch = engine.train_one_epoch

    def _failing_train_one_epoch(*args, **kwargs):
        if get_rank() == int(os.environ["FAIL_RANK"]):
            raise RuntimeError(f"failure injected on rank {get_rank()}")
        return _train_one_epoch(*args, **kwargs)

    engine.train_one_epoch = _failing_train_one_epoch

if "KILL_RANK" in os.environ and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
    import signal

    import multi_train_utils.train_eval_utils as engine
    from multi_train_utils.distributed_utils import get_rank

    _train_one_epoch = engine.train_one_epoch

    def _killed_after_one_step(loader):
        for step, batch in enumerate(loader):
            if step == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            yield batch

    def _killing_train_one_epoch(model, optimizer, data_loader, device, epoch):
        """SIGKILL (no clean-up, as the kernel's OOM killer would) rank KILL_RANK in the middle of epoch
        KILL_EPOCH of the first attempt."""
        if get_rank() == int(os.environ["KILL_RANK"]) and epoch == int(os.environ["KILL_EPOCH"]):
            data_loader = _killed_after_one_step(data_loader)
        return _train_one_epoch(model, optimizer, data_loader, device, epoch)

    engine.train_one_epoch = _killing_train_one_epoch

if "NAN_RANK" in os.environ:
    import multi_train_utils.train_eval_utils as engine
    from multi_train_utils.distributed_utils import get_rank

    _train_one_epoch = engine.train_one_epoch

    def _poisoned(loader):
        for step, (images, labels) in enumerate(loader):
            yield (images * float("nan") if step == 1 else images), labels

    def _nan_train_one_epoch(model, optimizer, data_loader, device, epoch):
        """Feed NaN images to rank NAN_RANK at step 1 of epoch NAN_EPOCH: its loss becomes NaN."""
        if get_rank() == int(os.environ["NAN_RANK"]) and epoch == int(os.environ["NAN_EPOCH"]):
            data_loader = _poisoned(data_loader)
        return _train_one_epoch(model, optimizer, data_loader, device, epoch)

    engine.train_one_epoch = _nan_train_one_epoch

if "HANG_RANK" in os.environ:
    import time

    import multi_train_utils.train_eval_utils as engine
    from multi_train_utils.distributed_utils import get_rank

    _train_one_epoch = engine.train_one_epoch

    def _hanging_train_one_epoch(model, optimizer, data_loader, device, epoch):
        """Rank HANG_RANK stops answering at the start of epoch HANG_EPOCH (a stuck loader, say)."""
        if get_rank() == int(os.environ["HANG_RANK"]) and epoch == int(os.environ["HANG_EPOCH"]):
            time.sleep(600)
        return _train_one_epoch(model, optimizer, data_loader, device, epoch)

    engine.train_one_epoch = _hanging_train_one_epoch
