"""How each training step runs, decided once from the flags so that the loop itself has no branches: autocast and
fp16's loss scaling, the memory format, accumulated batches, gradient clipping, MixUp or CutMix; and the images as
the model takes them (uint8 pixels become normalised floats on the device, inside the step)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .config import RunConfig
from .distributed_utils import print_main
from .errors import UserInputError

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
AMP_CHOICES = ("off", "auto", "bf16", "fp16")
Criterion = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (logits, targets) -> the batch's mean loss
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
