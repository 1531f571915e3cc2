"""A loss that became NaN or infinite: every process stops at the same step, and no checkpoint keeps the
weights it spoiled."""

from __future__ import annotations

import torch

from .distributed_utils import reduce_value
from .errors import UserInputError


class NonFiniteLossError(UserInputError):
    """The loss became NaN or infinite: training has diverged. Raised on every rank at the same step."""


def stop_if_diverged(non_finite: torch.Tensor, epoch: int, step: int) -> None:
    """Stop every process at the same step if the loss of any of them was NaN or infinite.

    One all-reduce tells every rank the same count, so all raise together; a rank that stopped alone
    would leave the others waiting for it in their next collective.
    """
    count = int(reduce_value(non_finite.detach().clone(), average=False).item())
    if count:
        raise NonFiniteLossError(f"epoch {epoch}, step {step}: the training loss became NaN or infinite "
                                 f"({count} time(s) since the last check), so training stopped; the last "
                                 "checkpoint written is kept. Try a smaller --lr")
