"""The optimizer step, as the rest of a run sees it: the optimizer and the learning-rate schedule, chosen separately
by flag (--opt, --sched, --warmup-epochs; add your own: one entry in OPTIMIZERS or SCHEDULES, and its name is a
choice of the flag), the lr scaling rule and the steps of an epoch, each written once; how each step runs, decided
once from the flags so that the loop has no branches (StepOptions: autocast and fp16's loss scaling, the memory
format, accumulated batches, gradient clipping, MixUp or CutMix); what the loop tells the hooks after each
optimizer step (StepEnd); and the hooks through which checkpoints, stops, logs and the features the flags switch
on meet the loop, at its edges (Hook)."""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import operator
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .config import RunConfig
from .distributed_utils import print_main, reduce_sums
from .errors import NonFiniteLossError, UserInputError

# name -> (the optimizer class, its own arguments, its default --weight-decay)
OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any], float]] = {
    "sgd": (torch.optim.SGD, {"momentum": 0.9}, 5e-3),  # the tutorial's
    "adamw": (torch.optim.AdamW, {}, 0.05),
}


def cosine(progress: float, lrf: float) -> float:
    """From 1 down to `lrf` along half a cosine (Bag of Tricks, arXiv:1812.01187)."""
    return ((1 + math.cos(progress * math.pi)) / 2) * (1 - lrf) + lrf


def step(progress: float, lrf: float) -> float:
    """A tenth as large after each third of training (lrf is not used)."""
    return 0.1 ** min(2, math.floor(progress * 3))


def constant(progress: float, lrf: float) -> float:
    return 1.0


# name -> the factor of the base lr at `progress` (0 at the end of the warm-up, 1 at the end of training)
SCHEDULES: dict[str, Callable[[float, float], float]] = {"cosine": cosine, "step": step, "constant": constant}


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Every parameter (frozen ones too, to train once unfrozen): weight decay for weights, none for biases and
    normalisation layers (1-D tensors), which it would only pull towards zero."""
    decayed, plain = [], []
    for param in model.parameters():
        (decayed if param.ndim > 1 else plain).append(param)
    groups = [{"params": decayed, "weight_decay": weight_decay}, {"params": plain, "weight_decay": 0.0}]
    return list(filter(operator.itemgetter("params"), groups))  # a model may have either kind only


def build_optimizer(model: nn.Module, name: str = "sgd", lr: float = 0.001,
                    weight_decay: float | None = None) -> torch.optim.Optimizer:
    """--opt over the trainable parameters, with --weight-decay (the optimizer's own default if None)."""
    optimizer_class, arguments, default_decay = OPTIMIZERS[name]
    groups = parameter_groups(model, default_decay if weight_decay is None else weight_decay)
    return optimizer_class(groups, lr=lr, **arguments, **fused_on_cuda(optimizer_class, groups))


def fused_on_cuda(optimizer_class: type[torch.optim.Optimizer], groups: list[dict[str, Any]]) -> dict[str, bool]:
    """fused=True on CUDA, where the optimizer has it: one kernel for all parameters, and GradScaler then checks
    for overflow on the GPU instead of waiting for it on the host every step."""
    if groups[0]["params"][0].is_cuda and "fused" in inspect.signature(optimizer_class).parameters:
        return {"fused": True}
    return {}


def scaled_lr(lr: float, world_size: int = 1, accum_steps: int = 1) -> float:
    """The lr of a step that learns from world_size x accum_steps batches, where `lr` (--lr) is that of one
    process's batch: proportionally larger (the linear scaling rule, Goyal et al. 2017). Written here alone."""
    return lr * world_size * accum_steps


def warmup_then(schedule: Callable[[float, float], float], lrf: float, warmup_steps: int,
                total_steps: int) -> Callable[[int], float]:
    """The factor of the base lr at each optimizer step (not epoch: a warm-up rises smoothly): a linear warm-up
    over `warmup_steps`, then `schedule`."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        return schedule((step - warmup_steps) / max(1, total_steps - warmup_steps), lrf)

    return factor


def build_scheduler(optimizer: torch.optim.Optimizer, name: str = "cosine", epochs: int = 1,
                    steps_per_epoch: int = 1, warmup_epochs: int = 0, lrf: float = 0.1,
                    ) -> torch.optim.lr_scheduler.LambdaLR:
    """--sched after --warmup-epochs, stepped after every optimizer step."""
    factor = warmup_then(SCHEDULES[name], lrf, warmup_epochs * steps_per_epoch, epochs * steps_per_epoch)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def optimizer_steps_per_epoch(batches: int, accum_steps: int = 1) -> int:
    """Optimizer steps in an epoch of `batches` batches: the last step may gather fewer than accum_steps. More
    accum_steps than batches are refused: the lr is multiplied by accum_steps for batches that would never come."""
    if accum_steps > batches:
        raise UserInputError(f"--accum-steps {accum_steps}: more than the {batches} batches each process trains on "
                             f"in an epoch; at most {batches}")
    return math.ceil(batches / accum_steps)


def scheduled_lr(scheduler: torch.optim.lr_scheduler.LRScheduler, step: int) -> float:
    """The lr of the first parameter group at optimizer step `step` (of a LambdaLR; else its lr now)."""
    if not isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
        return scheduler.get_last_lr()[0]
    return scheduler.base_lrs[0] * scheduler.lr_lambdas[0](step)


def align_schedule(scheduler: torch.optim.lr_scheduler.LRScheduler, step: int) -> None:
    """Put a per-step schedule at optimizer step `step`, its lr computed anew: a resumed run may take another
    number of steps per epoch (other processes or batches), and another lr or schedule (changed flags)."""
    if not isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
        return
    scheduler.last_epoch = step
    for group, base, factor in zip(scheduler.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas,
                                   strict=True):
        group["lr"] = base * factor(step)


# How each step runs, and what the hooks hear after it: decided once from the flags, so the loop has no branches.
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
AMP_CHOICES = ("off", "auto", "bf16", "fp16")
Criterion = Callable[[Any, torch.Tensor], torch.Tensor]  # (the model's output, targets) -> the batch's mean loss
BatchTransform = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def unchanged(images: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return images, labels


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
    def from_args(cls, args: RunConfig, device: torch.device, num_classes: int = 0) -> StepOptions:
        """--amp, --channels-last, --accum-steps, --clip-grad-norm and, over `num_classes`, MixUp or CutMix."""
        dtype = None if args.amp == "off" else autocast_dtype(args.amp, device, args.comm_hook)
        scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
        return cls(device.type, dtype, args.channels_last, args.accum_steps, scaler, clip_grad_norm=args.clip_grad_norm,
                   batch_transform=mixing(args.mixup_alpha, args.cutmix_alpha, num_classes) or unchanged)

    @property
    def memory_format(self) -> torch.memory_format:
        return torch.channels_last if self.channels_last else torch.preserve_format

    def to_device(self, images: Any, labels: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        return to_model_input(images, device, self.memory_format), labels.to(device, non_blocking=True)

    def autocast(self) -> contextlib.AbstractContextManager:
        return torch.autocast(self.device_type, dtype=self.amp_dtype, enabled=self.amp_dtype is not None)

    def clip_gradients(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
        """With --clip-grad-norm, clip the gradients' norm (the true gradients': unscaled first under fp16), and
        return it as the step's grad_norm; without, nothing."""
        if self.clip_grad_norm is None:
            return {}
        self.scaler.unscale_(optimizer)
        return {"grad_norm": nn.utils.clip_grad_norm_(model.parameters(), self.clip_grad_norm)}

    def no_sync(self, model: nn.Module, last_micro_step: bool) -> contextlib.AbstractContextManager:
        """DDP's no_sync on the micro-steps whose gradients only accumulate: one all-reduce per optimizer step."""
        skip = not self.sync_gradients or not last_micro_step
        return model.no_sync() if skip and isinstance(model, DistributedDataParallel) else contextlib.nullcontext()


def mixing(mixup_alpha: float, cutmix_alpha: float, num_classes: int) -> BatchTransform | None:
    """--mixup-alpha, --cutmix-alpha: blends each training batch by MixUp or CutMix (or either); None without."""
    if not (mixup_alpha or cutmix_alpha):
        return None
    from torchvision.transforms import v2  # only where a run blends its batches

    mixup = v2.MixUp(alpha=mixup_alpha, num_classes=num_classes) if mixup_alpha else None
    cutmix = v2.CutMix(alpha=cutmix_alpha, num_classes=num_classes) if cutmix_alpha else None
    return v2.RandomChoice([mixup, cutmix]) if mixup and cutmix else mixup or cutmix


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

    def stop_if_diverged(self, batch: int) -> None:
        """Stop every process at the same step if the loss of any of them was NaN or infinite since the last check.

        One all-reduce tells every rank the same count, so all raise together; a rank that stopped alone would leave
        the others waiting for it in their next collective.
        """
        count = int(reduce_sums({"non_finite": self.non_finite})["non_finite"])
        if count:
            raise NonFiniteLossError(f"epoch {self.epoch}, step {batch}: the training loss became NaN or infinite "
                                     f"({count} time(s) since the last check), so training stopped; the last "
                                     "checkpoint written is kept. Try a smaller --lr")

    def count(self, loss: torch.Tensor, images: int, stepped: bool, hooks: Hooks) -> None:
        """Add a batch's mean `loss` over `images` to the sums; after an optimizer step, tell the hooks."""
        self.loss_sum += loss.detach().float() * images
        self.non_finite += ~torch.isfinite(loss.detach())
        self.images += images
        if stepped:
            self.step += 1
            hooks.call("on_step_end", self)


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
