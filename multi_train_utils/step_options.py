"""How each training step runs: precision (autocast, loss scaling), memory format, accumulated batches,
and the move of a batch to the device. Decided once from the flags; the loop itself has no branches."""

from __future__ import annotations

import argparse
import contextlib
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .distributed_utils import print_main
from .errors import UserInputError
from .transforms import to_model_input
from .versions import cpu_has_bf16

AMP_CHOICES = ("off", "auto", "bf16", "fp16")


def autocast_dtype(amp: str, device: torch.device) -> torch.dtype | None:
    """The dtype of --amp on `device`, or None for full float32. auto: bf16 where the device computes in it
    (no loss scaling needed), fp16 on GPUs without bf16, float32 on CPUs without bf16."""
    if amp == "off":
        return None
    on_cuda = device.type == "cuda"
    # including_emulation=False: older GPUs emulate bf16, and slowly; they get fp16 with loss scaling.
    gpu_has_bf16 = on_cuda and torch.cuda.is_bf16_supported(including_emulation=False)
    if amp == "auto" and on_cuda:
        return torch.bfloat16 if gpu_has_bf16 else torch.float16
    if amp == "auto":
        if cpu_has_bf16():
            return torch.bfloat16
        print_main("--amp: this CPU has no bfloat16 instructions, so training stays in float32")
        return None
    if amp == "fp16" and not on_cuda:
        raise UserInputError("--amp fp16: float16 autocast needs a CUDA GPU; on the CPU use --amp bf16")
    if amp == "bf16" and on_cuda and not gpu_has_bf16:
        raise UserInputError("--amp bf16: this GPU has no bfloat16; use --amp fp16")
    if amp == "bf16" and not on_cuda and not cpu_has_bf16():
        print_main("--amp bf16: this CPU has no bfloat16 instructions; bf16 runs emulated, much slower than float32")
    return torch.bfloat16 if amp == "bf16" else torch.float16


@dataclass
class StepOptions:
    """How each step runs. The defaults are the plain loop: float32, default memory format, one
    optimizer step per batch."""

    device_type: str = "cpu"
    amp_dtype: torch.dtype | None = None
    channels_last: bool = False
    accum_steps: int = 1
    # float16 gradients underflow to zero without loss scaling; bfloat16 has float32's range and needs none.
    # Disabled, the scaler passes the loss and the step straight through: one loop for every precision.
    scaler: torch.amp.GradScaler = field(default_factory=lambda: torch.amp.GradScaler("cpu", enabled=False))
    # False only for the benchmark's no-communication bound: DDP never all-reduces the gradients.
    sync_gradients: bool = True
    # --label-smoothing: the training target puts this much of its weight evenly on every class.
    label_smoothing: float = 0.0
    # --clip-grad-norm: the largest L2 norm of all gradients together that a step may use; None: no limit.
    clip_grad_norm: float | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace, device: torch.device) -> StepOptions:
        dtype = autocast_dtype(args.amp, device)
        if dtype == torch.float16 and getattr(args, "comm_hook", "none") == "fp16":
            # PyTorch's fp16 hook casts the loss-scaled gradients to fp16 before dividing by the number of
            # processes: the sum overflows at a world-size-times smaller gradient than training itself.
            raise UserInputError("--comm-hook fp16 with fp16 autocast: the loss-scaled gradients overflow "
                                 "float16 in the all-reduce; use --comm-hook bf16")
        scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
        return cls(device.type, dtype, args.channels_last, args.accum_steps, scaler,
                   # absent from the benchmark's flags, which time the plain step
                   label_smoothing=getattr(args, "label_smoothing", 0.0),
                   clip_grad_norm=getattr(args, "clip_grad_norm", None))

    @property
    def memory_format(self) -> torch.memory_format:
        # NHWC: what tensor cores and oneDNN's fastest convolutions read.
        return torch.channels_last if self.channels_last else torch.preserve_format

    def to_device(self, images: torch.Tensor, labels: torch.Tensor, device: torch.device,
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """A batch as the model takes it, on the training device: uint8 pixels (a quarter of float32's bytes to
        copy, asynchronously from pinned memory), or JPEGs with --decode-on gpu, become normalised floats."""
        images = to_model_input(images, device, self.memory_format)
        return images, labels.to(device, non_blocking=True)

    def autocast(self) -> contextlib.AbstractContextManager:
        return torch.autocast(self.device_type, dtype=self.amp_dtype, enabled=self.amp_dtype is not None)

    def no_sync(self, model: nn.Module, last_micro_step: bool) -> contextlib.AbstractContextManager:
        """DDP's no_sync around the micro-steps whose gradients only accumulate: the all-reduce then
        runs once, in the backward of the last micro-step, instead of once per micro-step."""
        skip = not self.sync_gradients or not last_micro_step
        return model.no_sync() if skip and isinstance(model, DistributedDataParallel) else contextlib.nullcontext()
