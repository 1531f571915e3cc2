"""The shared engine of the three training scripts: process set-up, data, the loops, and what a run writes."""

from .distributed_utils import (
    DistContext,
    cleanup,
    get_rank,
    get_world_size,
    init_distributed_mode,
    is_dist_avail_and_initialized,
    is_main_process,
    reduce_value,
)
from .errors import UserInputError
from .train_eval_utils import evaluate, train_one_epoch

__all__ = [
    "DistContext",
    "UserInputError",
    "cleanup",
    "evaluate",
    "get_rank",
    "get_world_size",
    "init_distributed_mode",
    "is_dist_avail_and_initialized",
    "is_main_process",
    "reduce_value",
    "train_one_epoch",
]
