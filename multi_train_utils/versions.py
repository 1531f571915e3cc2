"""Which PyTorch releases this code runs on, and what differs between them.

The oldest supported pair is the one requirements.txt names and CI tests (.ci/oldest); the newest is whatever
pip installs. Every program stops with one line where an older pair is installed (`require_supported_pytorch`,
run when the package is first imported: it reads torch's version.py instead of importing torch, which takes
seconds while Ctrl-C is not yet caught). Why the oldest pair is torch 2.6 with torchvision 0.21:
- torch 2.6 brought ProcessContext.join(grace_period=...), with which the spawn script gives the other processes
  a few seconds to exit on their own after one failed, and kills those stuck in a collective a few seconds
  later. Older releases send SIGTERM at once and SIGKILL only after 30 s; doing otherwise there would mean
  copying join()'s own handling of the processes. (2.6 also brought _abort_process_group, needed since 2.6's
  destroy_process_group waits for NCCL's collectives in flight; before, it aborted them itself.)
- torchvision 0.21 is the release built for torch 2.6 (its wheels require torch 2.6.0 exactly).

The private PyTorch functions the engine uses are reached only from here, each behind a check that it exists
and a fallback for a release without it.

The scripts import the package (and so this) before anything slow, to catch Ctrl-C from the first moment: the
functions here that call torch import it themselves.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import sys
from typing import TYPE_CHECKING

from .errors import report

if TYPE_CHECKING:
    import torch.distributed as dist

OLDEST_TORCH = (2, 6)
OLDEST_TORCHVISION = (0, 21)


def dotted(release_number: tuple[int, int]) -> str:
    return ".".join(map(str, release_number))


def require_supported_pytorch() -> None:
    """Exit 2 with one line, before any work, where the installed torch or torchvision is older than supported."""
    torch_version, torchvision_version = installed_version("torch"), installed_version("torchvision")
    if torch_version and torchvision_version and (release(torch_version) < OLDEST_TORCH
                                                  or release(torchvision_version) < OLDEST_TORCHVISION):
        report(pytorch_too_old(torch_version, torchvision_version))
        sys.exit(2)


def pytorch_too_old(torch_version: str, torchvision_version: str) -> str:
    return (f"error: installed are torch {torch_version} and torchvision {torchvision_version}; this needs torch >= "
            f"{dotted(OLDEST_TORCH)} and torchvision >= {dotted(OLDEST_TORCHVISION)} "
            "(pip install -U -r requirements.txt)")


def release(version: str) -> tuple[int, int]:
    """(major, minor) of a version such as 2.6.0+cu124 or 2.7.0a0+git1a2b3c (a pre-release of 2.7 counts as 2.7)."""
    if not (found := re.match(r"(\d+)\.(\d+)", version)):
        raise ValueError(f"not a release number: {version!r}")
    return int(found[1]), int(found[2])


def installed_version(package: str) -> str | None:
    """The release of `package` as its version.py says, read without importing it; pip's record where it has none."""
    spec = importlib.util.find_spec(package)
    if spec is None:
        return None  # not installed
    for folder in spec.submodule_search_locations or []:
        with contextlib.suppress(OSError), open(os.path.join(folder, "version.py")) as file:
            if found := re.search(r"^__version__\s*=\s*['\"]([^'\"]+)", file.read(), re.MULTILINE):
                return found[1]
    return recorded_version(package)


def recorded_version(package: str) -> str | None:
    """pip's record of the release of `package` (importlib.metadata), for a package without a version.py."""
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def abort_process_group() -> None:
    """End the default process group's NCCL communicators at once, without waiting for the collectives in
    flight, which ranks that have failed will never finish."""
    import torch.distributed as dist

    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)  # private; torch 2.6 to 2.14 have it
    if abort is not None:
        abort()
    else:
        # What _abort_process_group does to each group, public since torch 2.7; the group stays registered,
        # which matters to nobody here: the process is on its way out after a failure.
        dist.group.WORLD.abort()


def has_default_store() -> bool:
    """Whether the key-value store the processes met in can be reached (see default_store)."""
    import torch.distributed as dist

    return hasattr(dist.distributed_c10d, "_get_default_store")


def default_store() -> dist.Store:
    """The key-value store of the default process group, shared by every process of the job.

    Private in every release up to 2.14 at least. Callers check has_default_store() first, and without a
    store behave as a job without a process group would: each failing process explains itself, and a time-out
    is reported as it came, without naming the ranks that stopped answering.
    """
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_store()


def flight_recorder_dump() -> bytes | None:
    """This process's flight-recorder record (its collectives, numbered, with the stacks that called them), pickled;
    None where the release has no dump to give. Private in every release up to 2.14: `_dump_fr_trace` covers every
    backend; releases without it have `_dump_nccl_trace`, which records NCCL's collectives only."""
    import torch

    c10d = torch._C._distributed_c10d
    dump = getattr(c10d, "_dump_fr_trace", None) or getattr(c10d, "_dump_nccl_trace", None)
    if dump is None:
        return None
    try:
        return dump(includeCollectives=True, includeStackTraces=True, onlyActive=False)
    except Exception:  # a release whose dump takes other arguments
        return None


def flight_recorder_size_variable() -> str:
    """The environment variable that sizes the flight recorder, read when a process group is made: renamed in the
    releases that have `_dump_fr_trace`, which call the old name deprecated."""
    import torch

    renamed = hasattr(torch._C._distributed_c10d, "_dump_fr_trace")
    return "TORCH_FR_BUFFER_SIZE" if renamed else "TORCH_NCCL_TRACE_BUFFER_SIZE"


def ddp_constructible_under_checks(backend: str) -> None:
    """Where PyTorch checks every collective (TORCH_DISTRIBUTED_DEBUG=DETAIL, --check-collectives) on gloo, DDP's
    constructor would die of a segmentation fault (torch 2.6 to 2.14.1 at least): its usage log reads gloo's thread
    count from the checking wrapper as if it were gloo's own group. In this process, DDP's logger then skips that
    log, which only PyTorch's own usage statistics read."""
    import torch.distributed as dist

    if dist.get_debug_level() != dist.DebugLevel.DETAIL or backend != "gloo":
        return

    class LoggerWithoutUsageLog(dist.Logger):  # type: ignore[misc]
        def set_construction_data_and_log(self, *args: object, **kwargs: object) -> None:
            pass

    dist.Logger = LoggerWithoutUsageLog  # DDP's constructor makes its logger as dist.Logger


def cpu_has_bf16() -> bool:
    """Whether this CPU computes in bfloat16 natively (AVX512-BF16 or AMX). Without them, bf16 autocast is
    emulated, and was 25 times slower than float32 for ResNet-34 on an AVX2-only CPU."""
    import torch

    capabilities = getattr(torch.cpu, "get_capabilities", None)  # public since torch 2.11
    if capabilities is not None:
        found = capabilities()
        return bool(found.get("avx512_bf16") or found.get("amx_tile"))
    # Before 2.11, private functions that ask the same CPU flags
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()

