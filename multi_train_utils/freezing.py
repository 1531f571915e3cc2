"""--freeze-layers: train only the classifier, the usual way to fine-tune pretrained weights on a small data set;
with --unfreeze-epoch N, every layer trains from epoch N on.

Which layers train is set at the start of every epoch from the epoch alone, so a resumed run freezes what the
stopped one froze. Every parameter stays in the optimizer (a frozen one has no gradient, so the optimizer leaves
it alone), and DDP is built with every parameter trainable and find_unused_parameters: it must know all the
parameters it will ever all-reduce when it is made, and accept those that get no gradient while frozen.
"""

from __future__ import annotations

from torch import nn

from .distributed_utils import print_main, unwrap_model
from .optim import Hook


def classifier_of(model: nn.Module) -> nn.Module:
    """The last layer, the one that maps features to classes (`fc` in ResNets, `classifier.N` elsewhere)."""
    last = None
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Conv2d)) and len(list(module.children())) == 0:
            last = module
    if last is None:
        raise ValueError(f"{type(model).__name__} has no linear or convolutional layer")
    return last


def freeze_all_but_classifier(model: nn.Module) -> None:
    model.requires_grad_(False)
    classifier_of(model).requires_grad_(True)


class FrozenBody(Hook):
    """Before `unfreeze_epoch` (None: never), only the classifier of `model` trains."""

    def __init__(self, model: nn.Module, unfreeze_epoch: int | None = None) -> None:
        self.model, self.unfreeze_epoch = unwrap_model(model), unfreeze_epoch

    def on_epoch_start(self, epoch: int) -> None:
        if self.unfreeze_epoch is not None and epoch >= self.unfreeze_epoch:
            if epoch == self.unfreeze_epoch:
                print_main(f"--unfreeze-epoch {self.unfreeze_epoch}: every layer trains from now on")
            self.model.requires_grad_(True)
        else:
            freeze_all_but_classifier(self.model)
