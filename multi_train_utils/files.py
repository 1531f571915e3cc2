"""Writing and reading the .pth files a run keeps: never half a file, tensors always on the CPU, and one line
naming the file when it cannot be written or read."""

from __future__ import annotations

import contextlib
import errno
import os
import pickle
import shutil
import signal
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from .errors import STOP_SIGNALS, UserInputError, path_kind

PARTIAL_SUFFIX = ".partial"
LOW_DISK_BYTES = 64 * 2**20


def map_tensors(function: Callable[[torch.Tensor], Any], tree: Any) -> Any:
    """`tree` (nested dicts, lists, tuples and namedtuples) with `function` applied to every tensor in it."""
    if isinstance(tree, torch.Tensor):
        return function(tree)
    if isinstance(tree, dict):
        return {key: map_tensors(function, value) for key, value in tree.items()}
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):  # a namedtuple, such as torchvision's InceptionOutputs
        return type(tree)(*(map_tensors(function, value) for value in tree))
    if isinstance(tree, (list, tuple)):
        return type(tree)(map_tensors(function, value) for value in tree)
    return tree


def to_cpu(tree: Any) -> Any:
    """`tree` (a state dict, nested dicts and lists) with every tensor copied to the CPU, so that a file
    saved on a GPU loads with a plain torch.load on a machine without one."""
    return map_tensors(lambda tensor: tensor.detach().cpu(), tree)


def save_atomic(obj: object, path: Path) -> None:
    """torch.save to a temporary file beside `path`, then rename: a crash never leaves half a file, and
    two processes writing the same name never share a temporary file. A write that fails (a full disk)
    removes its temporary file, so that it does not keep the disk full, and ends in one line."""
    try:
        handle, scratch = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=PARTIAL_SUFFIX)
    except OSError as err:
        raise cannot_write(path, err) from None
    try:
        os.chmod(scratch, 0o666 & ~current_umask())  # mkstemp's file is private; a saved file is not
        with stops_held():
            with os.fdopen(handle, "wb") as file:
                torch.save(obj, file)
            os.replace(scratch, path)
    except BaseException as err:
        with contextlib.suppress(OSError):
            os.unlink(scratch)
        if isinstance(err, (OSError, RuntimeError)):  # torch.save reports a failed write as a RuntimeError
            why = why_a_write_failed(err, path.parent, tensor_bytes(obj))
            raise UserInputError(f"cannot write {path}: {why}; the files written before it are kept") from None
        raise


@contextlib.contextmanager
def stops_held() -> Iterator[None]:
    """Ctrl-C or a stop signal during a write is acted on once the file is whole. Raised inside torch.save's
    writer, its exception would be lost there, turned into "unexpected pos": a Ctrl-C read as a bad disk."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signals reach only the main thread's handlers
        return
    held: list[int] = []
    handlers = {signum: signal.signal(signum, lambda signum, frame: held.append(signum))
                for signum in (signal.SIGINT, *STOP_SIGNALS)}
    try:
        yield
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
        for signum in dict.fromkeys(held):
            signal.raise_signal(signum)


def current_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def cannot_write(path: Path, err: OSError) -> UserInputError:
    """A write into `path`'s folder that failed, in one line: the folder deleted while the run wrote to it, a
    full disk, or the system's reason."""
    if isinstance(err, FileNotFoundError):
        return UserInputError(f"cannot write {path}: its folder {path.parent} is gone (deleted while the run wrote "
                              "to it?)")
    return UserInputError(f"cannot write {path}: {why_a_write_failed(err, path.parent)}")


def why_a_write_failed(err: BaseException, folder: Path, needed: int = 0) -> str:
    """A full disk in words, with what the write needed and what is free: torch.save says
    "basic_ios::clear: iostream error", which nobody reads as that."""
    free = shutil.disk_usage(folder).free
    sizes = f"the file needs about {megabytes(needed)}, {megabytes(free)} free" if needed else f"{megabytes(free)} free"
    if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"the disk is full, or the disk quota used up ({sizes})"
    if free < max(needed, LOW_DISK_BYTES):
        return f"the disk is full ({sizes})"
    return err.strerror if isinstance(err, OSError) and err.strerror else str(err).splitlines()[0]


def megabytes(size: int) -> str:
    return f"{size / 2**20:.1f} MB"


def tensor_bytes(tree: Any) -> int:
    """The bytes of the tensors in `tree` (nested dicts and lists): about what torch.save writes of it."""
    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(tensor_bytes(value) for value in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(tensor_bytes(value) for value in tree)
    return 0


def check_readable_file(path: Path, flag: str) -> None:
    """That `path` is a regular file with something in it, or one line saying what it is instead."""
    kind = path_kind(path, flag)
    if kind == "missing":
        raise UserInputError(f"{flag} {path}: no such file")
    if kind == "folder":
        raise UserInputError(f"{flag} {path}: is a folder; name the .pth file inside it")
    if kind == "other":
        raise UserInputError(f"{flag} {path}: not a regular file (a device, a pipe or a socket)")
    if path.stat().st_size == 0:
        raise UserInputError(f"{flag} {path}: is empty (0 bytes), perhaps a copy or download that broke off")


def load_file(path: Path, flag: str) -> Any:
    """torch.load of a file the user named, restricted to tensors and plain data (`weights_only`: a .pth file
    is a pickle, and unpickling an untrusted one can run any code); a file that is not such a file ends in
    one line of our own words, naming the flag and the file."""
    check_readable_file(path, flag)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        if "unsupported global" not in str(err).lower():
            raise UserInputError(f"{flag} {path}: not a PyTorch file (damaged, cut short, or another kind of file)"
                                 ) from None
        raise UserInputError(f"{flag} {path}: holds Python objects besides tensors, which are not loaded because "
                             "loading them could run any code; save a state_dict of tensors instead") from None
    except Exception:
        raise UserInputError(f"{flag} {path}: not a PyTorch file (damaged, cut short, or another kind of file)"
                             ) from None
