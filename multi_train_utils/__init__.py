"""The shared engine of the three training scripts: process set-up, data, the loops, and what a run writes.

The tutorial's helpers are importable from here (`from multi_train_utils import reduce_value`). They are
loaded on first use, so that a module that needs only `multi_train_utils.errors` (the dataset, the demo
data) does not load the whole engine, which itself imports those modules.

Each module has one concern, named for it:
  the loops          train_eval_utils (train_one_epoch, evaluate), fit (the epochs), hooks (the extension point)
  the step           step_options (precision, memory format, accumulation), optim (optimizer, schedule),
                     ddp (the wrapper), divergence (a loss gone NaN stops every rank)
  process set-up     launch (who started this process), distributed_utils (the process group, rank helpers),
                     spawn_utils (the spawn script's processes), shutdown (how every process of a job ends)
  data               data (split, datasets, samplers, loaders), loader_workers, transforms
  a run's files      checkpoint (what resumes a run), recorder (what a run writes), files (writes never left
                     half done, loads that name the file), confusion and pictures (what validation draws)
  flags              cli; errors (the ways a run ends early, in one line)
  PyTorch releases   versions (which releases are supported, and the calls that differ between them)
  optional features  features lists them: ema, preemption, periodic_checkpoints, tensorboard_log; and gpu_decode
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
