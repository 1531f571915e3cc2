"""The shared engine of the three training scripts: process set-up, data loaders, the loops, and what a run
writes. It imports nothing from the scripts' own files: they hand it the model, the datasets and the loss.

The tutorial's helpers are importable from here (`from multi_train_utils import reduce_value`), loaded on first
use: the scripts import `multi_train_utils.errors` before anything slow, to catch Ctrl-C from the first moment.

Each module has one concern, named for it:
  the lesson         distributed_utils (the process group: joining it, rank helpers, reductions, the DDP wrapper),
                     train_eval_utils (train_one_epoch, evaluate, and fit, which runs them epoch after epoch)
  beside the loop    optim (the optimizer step: optimizer and lr schedule by flag, the lr scaling rule, how each
                     step runs: precision, memory format, accumulation; and the hooks through which the rest meets
                     the loop), features (what a run attaches to it, in one place, and the stop at a step when a
                     scheduler asks)
  process set-up     launch (who started this process, its device and CPU share, where the processes meet),
                     meeting (the one line when they do not), spawn_utils (around the spawn script's mp.spawn),
                     shutdown (how every process of a job ends together), flight_recorder (where each rank
                     waits when a collective never completes: PyTorch's record of the collectives, read after one
                     has failed)
  data               data (samplers, loaders, the loader's worker processes)
  a run's files      recorder (the run's folder: which file is where, its lock, one run per folder, rewinds; and
                     what a run writes: metrics, weights, TensorBoard), checkpoint (what resumes a run, what
                     "best" means), files (writes never left half done, loads that name the file),
                     confusion and pictures (what validation counts and draws)
  flags              config (what a run is: every flag as one value, and what a resume does with each), cli (the
                     command line, and run_cli, through which every script runs); errors (the ways a run ends
                     early, in one line)
  PyTorch releases   versions (which releases are supported, and the calls that differ between them)
  optional features  imported only when their flag is on (features.attach): ema, periodic_checkpoints, freezing;
                     and gpu_decode (utils.build_datasets)
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
    "train_one_epoch": "train_eval_utils", "fit": "train_eval_utils",
}
__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_HOMES[name]}", __name__), name)
