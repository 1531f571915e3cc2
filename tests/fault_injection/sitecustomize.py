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
