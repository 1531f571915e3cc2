"""Everything a run writes, written by rank 0 alone, all under --output-dir."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from torch import nn

from .distributed_utils import DistContext, unwrap_model
from .errors import UserInputError


def save_atomic(obj: object, path: Path) -> None:
    """torch.save to a temporary file beside `path`, then rename: a crash never leaves half a file."""
    scratch = path.with_name(f".{path.name}.partial")
    torch.save(obj, scratch)
    os.replace(scratch, path)


class RunRecorder:
    """Writes class_indices.json, metrics.jsonl, TensorBoard events and weights/model-{epoch}.pth.

    On ranks other than 0 every method does nothing, so the training loop never checks the rank.
    """

    def __init__(self, output_dir: str | os.PathLike, ctx: DistContext, class_names: list[str],
                 args: dict[str, Any] | None = None) -> None:
        self.enabled = ctx.is_main
        self.output_dir = Path(output_dir)
        self.weights_dir = self.output_dir / "weights"
        if not self.enabled:
            return
        try:
            self.weights_dir.mkdir(parents=True, exist_ok=True)
            (self.output_dir / "class_indices.json").write_text(
                json.dumps(dict(enumerate(class_names)), indent=4) + "\n")
            self.metrics_file = open(self.output_dir / "metrics.jsonl", "w")  # noqa: SIM115 - closed in close()
        except OSError as err:
            raise UserInputError(f"--output-dir {self.output_dir}: cannot write there ({err.strerror})") from None
        from torch.utils.tensorboard import SummaryWriter  # slow to import; only rank 0 needs it

        self.tensorboard = SummaryWriter(log_dir=str(self.output_dir / "tensorboard"))
        if args is not None:
            self.tensorboard.add_text("args", "\n".join(f"    {k}: {v}" for k, v in sorted(args.items())))
        print(f"Writing to {self.output_dir} (TensorBoard: tensorboard --logdir {self.output_dir})", flush=True)

    def end_epoch(self, model: nn.Module, metrics: dict[str, Any]) -> None:
        """Print the epoch's one-line summary, append it to metrics.jsonl and TensorBoard, save the weights."""
        if not self.enabled:
            return
        epoch = metrics["epoch"]
        print(f"[epoch {epoch}] train_loss {metrics['train_loss']:.4f}  val_loss {metrics['val_loss']:.4f}  "
              f"val_acc {metrics['val_acc']:.3f} ({metrics['val_correct']}/{metrics['val_total']})  "
              f"lr {metrics['lr']:.2e}  {metrics['images_per_s']:.1f} img/s  {metrics['epoch_time_s']:.1f} s",
              flush=True)
        self.metrics_file.write(json.dumps(metrics) + "\n")
        self.metrics_file.flush()
        for name in ("train_loss", "val_loss", "val_acc", "lr", "images_per_s", "epoch_time_s"):
            self.tensorboard.add_scalar(name, metrics[name], epoch)
        self.tensorboard.flush()
        # The plain model's weights: no "module." prefix, loadable without DDP.
        save_atomic(unwrap_model(model).state_dict(), self.weights_dir / f"model-{epoch}.pth")

    def close(self) -> None:
        if self.enabled:
            self.metrics_file.close()
            self.tensorboard.close()

    def __enter__(self) -> RunRecorder:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
