"""--checkpoint-every-steps and --checkpoint-every-minutes: checkpoints inside an epoch as well, so that a run
stopped without warning (a lost machine, a kill) loses at most that much training."""

from __future__ import annotations

import time

from .checkpoint import Checkpointer
from .distributed_utils import any_rank, cpu_side_group, is_main_process
from .optim import Hook, StepEnd


class PeriodicCheckpoints(Hook):
    """Writes the checkpoint after every `every_steps` optimizer steps, counted over the whole run, and at the
    first step `every_minutes` after the last checkpoint, by rank 0's clock (each rank's own would disagree by
    a step now and then; the ranks agree on rank 0's answer)."""

    def __init__(self, checkpoints: Checkpointer, every_steps: int | None, every_minutes: float | None,
                 timeout_s: float) -> None:
        self.checkpoints, self.every_steps = checkpoints, every_steps
        self.every_s = every_minutes * 60 if every_minutes else None
        self.group = cpu_side_group(timeout_s) if every_minutes else None

    def on_step_end(self, step: StepEnd) -> None:
        by_steps = bool(self.every_steps) and step.run_step % self.every_steps == 0
        if by_steps or self.minutes_passed():
            self.checkpoints.save_at(step)

    def minutes_passed(self) -> bool:
        if not self.every_s:
            return False
        return any_rank(is_main_process() and time.monotonic() - self.checkpoints.saved_at >= self.every_s, self.group)
