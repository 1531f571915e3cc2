"""The shared engine of the three training scripts: process set-up, data, the loops, and what a run writes.

The tutorial's helpers are importable from here (`from multi_train_utils import reduce_value`). They are
loaded on first use, so that a module that needs only `multi_train_utils.errors` (the dataset, the demo
data) does not load the whole engine, which itself imports those modules.
"""

import importlib
from typing import Any

from .versions import require_supported_pytorch

# Every program here imports this package before it does any work: on a PyTorch older than the oldest
# supported one, it stops here with one line instead of failing later on a missing function.
require_supported_pytorch()

_HOMES = {
    "DistContext": "distributed_utils", "cleanup": "distributed_utils", "get_rank": "distributed_utils",
    "get_world_size": "distributed_utils", "init_distributed_mode": "distributed_utils",
    "is_dist_avail_and_initialized": "distributed_utils", "is_main_process": "distributed_utils",
    "reduce_value": "distributed_utils", "UserInputError": "errors", "evaluate": "train_eval_utils",
    "train_one_epoch": "train_eval_utils",
}
__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_HOMES[name]}", __name__), name)
