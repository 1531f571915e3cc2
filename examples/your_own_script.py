"""The engine in a script of your own: your model, your data and your loss; `fit` trains and validates them in
one process or many, without a run folder (nothing is written). With the engine installed (pip install -e .):

    python examples/your_own_script.py
    torchrun --standalone --nproc_per_node=2 examples/your_own_script.py
"""

import torch
from torch import nn
from torch.utils.data import TensorDataset

from multi_train_utils.data import build_loaders
from multi_train_utils.distributed_utils import cleanup, init_distributed_mode, print_main, wrap_ddp
from multi_train_utils.train_eval_utils import fit


def focal_loss(logits: torch.Tensor, targets: torch.Tensor, gamma: float = 2.0) -> torch.Tensor:
    """Cross-entropy that weighs the images the model already gets right less (Lin et al. 2017)."""
    cross_entropy = nn.functional.cross_entropy(logits, targets, reduction="none")
    return ((1 - torch.exp(-cross_entropy)) ** gamma * cross_entropy).mean()


def three_clouds(count: int, seed: int) -> TensorDataset:
    """Points around three centres, labelled by their centre."""
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 3, (count,), generator=generator)
    centres = torch.tensor([[0.0, 3.0], [3.0, -2.0], [-3.0, -2.0]])
    return TensorDataset(centres[labels] + torch.randn(count, 2, generator=generator), labels)


def main() -> None:
    ctx = init_distributed_mode("cpu")  # one process, or the process group of torchrun
    torch.manual_seed(0)  # every process builds the same model; DDP checks it and keeps them equal
    train_loader, val_loader = build_loaders(three_clouds(512, seed=1), three_clouds(128, seed=2), batch_size=16,
                                             ctx=ctx, workers=0)
    model = wrap_ddp(nn.Sequential(nn.Linear(2, 32), nn.ReLU(), nn.Linear(32, 3)), ctx)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1 * ctx.world_size, momentum=0.9)
    result = fit(model, focal_loss, optimizer, train_loader, val_loader, ctx.device, epochs=3)
    print_main(f"validation: {result.correct} of {result.total} right")
    cleanup()


if __name__ == "__main__":
    main()
