"""The training and validation loops, the only ones in the repository, for one process or many; how each step
runs (precision, memory format, accumulated batches); and the hooks through which the rest of a run
(checkpoints, stops, logs) meets the loop, at its edges.

train_one_epoch is the tutorial's loop plus what DDP really needs (autocast, no_sync accumulation, the loss
summed without waiting for the device); evaluate sums its figures exactly over the processes; fit.py runs
them epoch after epoch. Both take the loss (the criterion) from the script that calls them.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from tqdm import tqdm

from .config import RunConfig
from .confusion import class_figures, class_sums, per_class
from .data import workers_ended
from .distributed_utils import broadcast_buffers_from_main, is_main_process, print_main, reduce_sums, unwrap_model
from .errors import UserInputError

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
AMP_CHOICES = ("off", "auto", "bf16", "fp16")
LOG_EVERY = 10  # batches between progress-bar updates; each update waits for the device
# One process draws the bars, so a thread lock will do. tqdm's own is a multiprocessing semaphore, which a
# process killed outright leaves behind, and the spawn script's resource tracker then warns of it.
tqdm.set_lock(threading.RLock())
Criterion = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (logits, targets) -> the batch's mean loss
BatchTransform = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def unchanged(images: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return images, labels


class NonFiniteLossError(UserInputError):
    """The loss became NaN or infinite: training has diverged. Raised on every rank at the same step."""


@dataclass
class StepOptions:
    """How each step runs, decided once from the flags, so that the loop itself has no branches."""

    device_type: str = "cpu"
    amp_dtype: torch.dtype | None = None  # autocast's; None: float32
    channels_last: bool = False  # NHWC: what tensor cores and oneDNN's fastest convolutions read
    accum_steps: int = 1
    # Loss scaling, which float16 gradients need (they underflow without); disabled, it passes everything through.
    scaler: torch.amp.GradScaler = field(default_factory=lambda: torch.amp.GradScaler("cpu", enabled=False))
    sync_gradients: bool = True  # False only for the benchmark's bound without communication
    clip_grad_norm: float | None = None  # the largest L2 norm of all gradients together that a step may use
    batch_transform: BatchTransform = unchanged  # each training batch, on the device: MixUp, CutMix

    @classmethod
    def from_args(cls, args: RunConfig, device: torch.device,
                  batch_transform: BatchTransform | None = None) -> StepOptions:
        dtype = None if args.amp == "off" else autocast_dtype(args.amp, device, args.comm_hook)
        return cls(device.type, dtype, args.channels_last, args.accum_steps,
                   torch.amp.GradScaler(device.type, enabled=dtype == torch.float16),
                   clip_grad_norm=args.clip_grad_norm, batch_transform=batch_transform or unchanged)

    @property
    def memory_format(self) -> torch.memory_format:
        return torch.channels_last if self.channels_last else torch.preserve_format

    def to_device(self, images: Any, labels: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        return to_model_input(images, device, self.memory_format), labels.to(device, non_blocking=True)

    def autocast(self) -> contextlib.AbstractContextManager:
        return torch.autocast(self.device_type, dtype=self.amp_dtype, enabled=self.amp_dtype is not None)

    def no_sync(self, model: nn.Module, last_micro_step: bool) -> contextlib.AbstractContextManager:
        """DDP's no_sync on the micro-steps whose gradients only accumulate: one all-reduce per optimizer step."""
        skip = not self.sync_gradients or not last_micro_step
        return model.no_sync() if skip and isinstance(model, DistributedDataParallel) else contextlib.nullcontext()


def autocast_dtype(amp: str, device: torch.device, comm_hook: str = "none") -> torch.dtype | None:
    """The dtype of --amp on `device`, or None for full float32. auto: bf16 where the device computes in it
    (no loss scaling needed), fp16 on GPUs without bf16, float32 on CPUs without bf16."""
    from .versions import cpu_has_bf16

    if amp == "off":
        return None
    on_cuda = device.type == "cuda"
    # including_emulation=False: older GPUs emulate bf16, and slowly; they get fp16 with loss scaling.
    gpu_has_bf16 = on_cuda and torch.cuda.is_bf16_supported(including_emulation=False)
    if amp == "auto" and on_cuda:
        amp = "bf16" if gpu_has_bf16 else "fp16"
    elif amp == "auto":
        if cpu_has_bf16():
            return torch.bfloat16
        print_main("--amp: this CPU has no bfloat16 instructions, so training stays in float32")
        return None
    if amp == "fp16" and not on_cuda:
        raise UserInputError("--amp fp16: float16 autocast needs a CUDA GPU; on the CPU use --amp bf16")
    if amp == "fp16" and comm_hook == "fp16":
        # PyTorch's fp16 hook casts the loss-scaled gradients to fp16 before dividing by the number of
        # processes: the sum overflows at a world-size-times smaller gradient than training itself.
        raise UserInputError("--comm-hook fp16 with fp16 autocast: the loss-scaled gradients overflow "
                             "float16 in the all-reduce; use --comm-hook bf16")
    if amp == "bf16" and on_cuda and not gpu_has_bf16:
        raise UserInputError("--amp bf16: this GPU has no bfloat16; use --amp fp16")
    if amp == "bf16" and not on_cuda and not cpu_has_bf16():
        print_main("--amp bf16: this CPU has no bfloat16 instructions; bf16 runs emulated, much slower than float32")
    return torch.bfloat16 if amp == "bf16" else torch.float16


def to_model_input(images: Any, device: torch.device,
                   memory_format: torch.memory_format = torch.preserve_format) -> torch.Tensor:
    """A loader's batch on `device` as the model takes it: uint8 pixels become float32, ImageNet-normalised."""
    if not isinstance(images, torch.Tensor):  # JPEG files of --decode-on gpu (gpu_decode.EncodedBatch)
        images = images.decode_and_augment(device)
    # Copied and laid out as uint8, a quarter of float32's bytes.
    images = images.to(device, non_blocking=True).to(memory_format=memory_format)
    if images.dtype != torch.uint8:
        return images
    mean, scale = normalisation(images.device)  # (x / 255 - mean) / std as one subtraction, one multiplication
    return (images.float() - mean) * scale


@functools.cache
def normalisation(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """ImageNet's mean and 1/std in pixel units, made once per device (copied every step, they would stall it)."""
    mean = torch.tensor(IMAGENET_MEAN, device=device).view(1, 3, 1, 1) * 255
    return mean, 1 / (torch.tensor(IMAGENET_STD, device=device).view(1, 3, 1, 1) * 255)


@dataclass
class StepEnd:
    """What the loop tells the hooks after each optimizer step (tensors stay on the device until read)."""

    epoch: int
    step: int  # optimizer steps done in the epoch (a resumed epoch's first part included)
    steps_per_epoch: int
    images: int  # images this process has trained on in this call, their summed loss, their non-finite losses
    loss_sum: torch.Tensor
    non_finite: torch.Tensor
    model: nn.Module
    figures: dict[str, Any] = field(default_factory=dict)  # the step's own: loss, lr (TensorBoard draws them)

    @property
    def run_step(self) -> int:  # optimizer steps since the start of the run
        return self.epoch * self.steps_per_epoch + self.step


class Hook:
    """A feature attached to training. Every method is optional and runs on every rank: a hook that writes
    files does so on rank 0 alone, and one that runs a collective runs it on every rank."""

    name: str | None = None  # the key of state_dict() in the checkpoint; None: the hook keeps no state

    def on_fit_start(self) -> None:
        """Before the first epoch."""

    def on_epoch_start(self, epoch: int) -> None:
        """Before the epoch's first batch is loaded."""

    def on_first_batch(self, images: Any, labels: torch.Tensor) -> None:
        """The epoch's first batch, as the loader gives it (before it moves to the device)."""

    def on_step_end(self, step: StepEnd) -> None:
        """After each optimizer step (and the schedule's)."""

    def on_validation_end(self, epoch: int, metrics: dict[str, Any]) -> None:
        """After validation; `metrics` is the epoch's line of metrics.jsonl, to which a hook may add figures."""

    def on_epoch_end(self, epoch: int, metrics: dict[str, Any]) -> None:
        """After the epoch's metrics, weights and checkpoint are written."""

    def on_fit_end(self) -> None:
        """After training, however it ended."""

    def state_dict(self) -> Any:
        """What the checkpoint keeps of this hook, under `name`."""
        return None


class Hooks(list):
    """Hooks called in turn, in their order (at the end, in reverse)."""

    def __init__(self, hooks: Iterable[Hook | None] = ()) -> None:
        super().__init__(filter(None, hooks))

    def call(self, event: str, *args: Any) -> None:
        for hook in reversed(self) if event == "on_fit_end" else self:
            getattr(hook, event)(*args)

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """on_fit_start before the block, on_fit_end after it, however it ends."""
        self.call("on_fit_start")
        try:
            yield
        finally:
            self.call("on_fit_end")


def train_one_epoch(model: nn.Module, criterion: Criterion, optimizer: torch.optim.Optimizer,
                    data_loader: DataLoader, device: torch.device, epoch: int,
                    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
                    options: StepOptions | None = None, hooks: Hooks | None = None) -> float:
    """Train on this process's share of one epoch; return the mean loss over all processes' images. With
    options.accum_steps K, K batches of b images take the step of one batch of K*b (BatchNorm aside)."""
    options, hooks = options or StepOptions(device.type), hooks or Hooks()
    model.train()
    done, batches = batches_done(data_loader)
    # Summed on the device and read every LOG_EVERY batches: reading them every batch would stall the GPU.
    state = StepEnd(epoch, done // options.accum_steps, -(-batches // options.accum_steps), 0,
                    torch.zeros((), device=device), torch.zeros((), device=device), model)
    optimizer.zero_grad(set_to_none=True)
    with tqdm(data_loader, desc=f"[epoch {epoch}] train", file=sys.stdout, disable=not is_main_process(),
              dynamic_ncols=True, initial=done, total=batches) as bar:
        for i, (images, labels) in enumerate(bar):
            if i == 0:
                hooks.call("on_first_batch", images, labels)
            images, labels = options.batch_transform(*options.to_device(images, labels, device))
            group_size, last_of_group = accumulation_group(i, len(data_loader), options.accum_steps)
            # Each process's loss is its own; DDP averages the gradients across processes inside backward(),
            # once per group of accumulated batches (no_sync skips it for the others).
            with options.no_sync(model, last_of_group):
                with options.autocast():
                    loss = criterion(model(images), labels)
                options.scaler.scale(loss / group_size).backward()
            state.loss_sum += loss.detach().float() * labels.size(0)
            state.non_finite += ~torch.isfinite(loss.detach())
            state.images += labels.size(0)
            if last_of_group:
                state.figures = {"loss": loss.detach(), "lr": optimizer.param_groups[0]["lr"]}
                if options.clip_grad_norm is not None:  # on the true gradients: unscaled first under fp16
                    options.scaler.unscale_(optimizer)
                    state.figures["grad_norm"] = nn.utils.clip_grad_norm_(model.parameters(), options.clip_grad_norm)
                options.scaler.step(optimizer)  # with fp16, skipped if the gradients overflowed
                options.scaler.update()
                optimizer.zero_grad(set_to_none=True)
                if scheduler is not None:
                    scheduler.step()
                state.step += 1
                hooks.call("on_step_end", state)
            if (i + 1) % LOG_EVERY == 0:
                stop_if_diverged(state.non_finite, epoch, i)
                bar.set_postfix(loss=f"{loss.item():.3f}", lr=f"{optimizer.param_groups[0]['lr']:.2e}")
    stop_if_diverged(state.non_finite, epoch, len(data_loader) - 1)
    totals = reduce_sums({"loss": state.loss_sum, "images": torch.tensor(float(state.images), device=device)})
    return (totals["loss"] / totals["images"]).item()


def batches_done(data_loader: DataLoader) -> tuple[int, int]:
    """The batches of the epoch trained before (by the run this one resumes) and all of them."""
    sampler, batch_size = getattr(data_loader, "sampler", None), getattr(data_loader, "batch_size", None) or 1
    done = getattr(sampler, "skipped", 0) // batch_size
    return done, getattr(sampler, "epoch_length", 0) // batch_size or done + len(data_loader)


def accumulation_group(batch: int, batches: int, accum_steps: int) -> tuple[int, bool]:
    """The size of the group of accumulated batches `batch` is in (the epoch's last may be smaller), and
    whether `batch` is its last."""
    group_start = batch - batch % accum_steps
    group_size = min(accum_steps, batches - group_start)
    return group_size, batch == group_start + group_size - 1


def stop_if_diverged(non_finite: torch.Tensor, epoch: int, step: int) -> None:
    """Stop every process at the same step if the loss of any of them was NaN or infinite.

    One all-reduce tells every rank the same count, so all raise together; a rank that stopped alone
    would leave the others waiting for it in their next collective.
    """
    count = int(reduce_sums({"non_finite": non_finite})["non_finite"])
    if count:
        raise NonFiniteLossError(f"epoch {epoch}, step {step}: the training loss became NaN or infinite "
                                 f"({count} time(s) since the last check), so training stopped; the last "
                                 "checkpoint written is kept. Try a smaller --lr")


def batch_sums(logits: torch.Tensor, labels: torch.Tensor, criterion: Criterion,
               num_classes: int | None) -> dict[str, torch.Tensor]:
    """One validation batch's figures as sums, each by name: added up over the batches and the processes, then
    turned into the epoch's metrics by EvalResult.figures. A new metric is one more sum here, and its figure
    there; it is then exact on any number of processes, and logged everywhere."""
    predictions = logits.argmax(dim=1)
    sums = {"correct": (predictions == labels).sum(), "total": torch.tensor(labels.numel(), device=labels.device),
            # the criterion's mean over the batch, times its size: the sum, whichever the batch sizes
            "loss": criterion(logits.float(), labels) * labels.numel() if labels.numel() else logits.sum()}
    if num_classes:
        sums.update(class_sums(labels, predictions, num_classes))
    return sums


@dataclass(frozen=True)
class EvalResult:
    """Every sum of batch_sums over the whole validation set and every process, and the figures made of them."""

    sums: dict[str, torch.Tensor]

    @property
    def correct(self) -> int:
        return int(self.sums["correct"])

    @property
    def total(self) -> int:
        return int(self.sums["total"])

    @property
    def accuracy(self) -> float:
        return self.correct / self.total if self.total else 0.0

    @property
    def loss(self) -> float:
        return float(self.sums["loss"]) / self.total if self.total else float("nan")

    def figures(self) -> dict[str, Any]:
        """Validation's figures in metrics.jsonl and --eval-only (confusion.class_figures adds the classes')."""
        return {"val_correct": self.correct, "val_total": self.total, "val_acc": self.accuracy, "val_loss": self.loss}


@torch.no_grad()
def evaluate(model: nn.Module, criterion: Criterion, data_loader: DataLoader, device: torch.device,
             options: StepOptions | None = None, num_classes: int | None = None) -> EvalResult:
    """Correct count, image count, mean loss and confusion matrix over the whole validation set, summed
    over processes.

    Each process evaluates its own unpadded share with the plain model (not DDP, so ranks with one batch
    more or less never wait for each other); one all-reduce then adds all the sums. Without
    `num_classes` no matrix is counted: every rank must all-reduce sums of one size, and a rank without a
    batch could not learn the width of the model's output.
    """
    options = options or StepOptions(device.type)
    broadcast_buffers_from_main(model)  # every rank evaluates the model that rank 0 saves
    model = unwrap_model(model)  # uncompiled too: evaluating does not pay for a second compilation
    model.eval()
    # The sums of an empty batch: where they start, and all a rank without a validation image adds.
    sums = batch_sums(torch.zeros(0, num_classes or 1, device=device), torch.zeros(0, dtype=torch.long, device=device),
                      criterion, num_classes)
    # A bar that erases itself when done: on a terminal only, where erasing works; in a log file or a pipe
    # it would leave its frames in front of the next line (the JSON line of --eval-only).
    for images, labels in tqdm(data_loader, desc="validate", file=sys.stdout, leave=False, dynamic_ncols=True,
                               disable=not (is_main_process() and sys.stdout.isatty())):
        images, labels = options.to_device(images, labels, device)
        with options.autocast():
            logits = model(images)
        for name, value in batch_sums(logits, labels, criterion, num_classes).items():
            sums[name] += value
    return EvalResult(reduce_sums(sums))


def evaluate_only(model: nn.Module, criterion: Criterion, val_loader: DataLoader, device: torch.device,
                  options: StepOptions, class_names: list[str]) -> EvalResult:
    """--eval-only: validate the loaded weights once and print the figures as the last line of standard
    output, one JSON object (rank 0 alone): the numbers of the epoch that saved the weights."""
    with workers_ended(val_loader):
        result = evaluate(model, criterion, val_loader, device, options, len(class_names))
    if not math.isfinite(result.loss):  # the same on every rank
        raise NonFiniteLossError(f"--eval-only: the validation loss of these weights is {result.loss}: they have "
                                 "diverged; validate an earlier epoch's weights/model-N.pth instead")
    if is_main_process():  # every class's figures, at any number of classes (a line of metrics.jsonl: up to 100)
        figures = {**result.figures(), **class_figures(result.sums, class_names),
                   "per_class": per_class(result.sums, class_names)}
        print(json.dumps(figures, allow_nan=False), flush=True)
    return result
