"""The supported PyTorch range, checked at start-up and in CI, and the fallback of each private PyTorch function."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn

from conftest import REPO, python, run
from multi_train_utils import shutdown, versions
from multi_train_utils.distributed_utils import unwrap_model
from multi_train_utils.versions import (
    OLDEST_TORCH,
    OLDEST_TORCHVISION,
    abort_process_group,
    cpu_has_bf16,
    release,
    require_supported_pytorch,
)

# Each program with the too old package faked; two of them in the quick tests, all in the full run.
OLDER_PYTORCH = [("train_single_gpu.py", "torch"), ("train_multi_gpu_using_spawn.py", "torchvision"),
                 *(pytest.param(script, "torch", marks=pytest.mark.slow) for script in (
                     "train_multi_gpu_using_launch.py", "predict.py", "show_batch.py", "plot_runs.py",
                     "bench/benchmark.py", "bench/gpu_check.py"))]


def test_release_numbers_compare_as_numbers_whatever_their_suffix() -> None:
    assert release("2.6.0+cu124") == (2, 6) and release("2.7.0a0+git1a2b3c") == (2, 7)
    assert release("2.10.1") > release("2.9.0")  # as text, "2.10" sorts before "2.9"
    with pytest.raises(ValueError, match="not a release number"):
        release("unknown")


@pytest.mark.parametrize(("installed", "supported"), [
    (("2.6.0+cu124", "0.21.0+cu124"), True), (("2.14.1", "0.29.1"), True), (("3.0.0", "1.0.0"), True),
    (("2.5.1+cu124", "0.20.1+cu124"), False), (("2.6.0", "0.20.1"), False), (("1.13.1", "0.14.1"), False)])
def test_an_older_pair_than_the_oldest_supported_is_refused_naming_both_versions(
        installed: tuple[str, str], supported: bool, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(versions, "installed_version", {"torch": installed[0], "torchvision": installed[1]}.get)
    if supported:
        require_supported_pytorch()
        assert capsys.readouterr().err == ""
        return
    with pytest.raises(SystemExit) as stop:
        require_supported_pytorch()
    problem = capsys.readouterr().err
    assert stop.value.code == 2 and problem.count("\n") == 1 and problem.startswith("error: ")
    assert f"torch {installed[0]} and torchvision {installed[1]}" in problem
    needed = versions.dotted(OLDEST_TORCH), versions.dotted(OLDEST_TORCHVISION)
    assert f"torch >= {needed[0]} and torchvision >= {needed[1]}" in problem


def test_the_release_is_read_from_version_py_else_from_pips_record() -> None:
    from importlib import metadata

    assert versions.installed_version("torch") == torch.__version__  # torch/version.py
    assert versions.installed_version("pytest") == metadata.version("pytest")  # a package without a version.py
    assert versions.installed_version("no_such_package_installed") is None


def test_the_check_runs_before_the_ctrl_c_guard_without_importing_torch_or_package_metadata() -> None:
    """The scripts catch Ctrl-C right after importing the package, whose import runs the check: it must not take
    the seconds of `import torch`, nor the tenth of one of importlib.metadata, where version.py says it."""
    code = ("import sys, time; started = time.perf_counter(); import multi_train_utils.errors; "
            "print(time.perf_counter() - started, sorted({'torch', 'torchvision', 'importlib.metadata'} & "
            "set(sys.modules)))")
    result = run([python(), "-c", code], cwd=REPO, timeout=60)
    took, imported = result.stdout.split(" ", 1)
    assert imported.strip() == "[]" and float(took) < 0.5, result.stdout + result.stderr


def test_requirements_name_the_oldest_supported_pair() -> None:
    requirements = (REPO / "requirements.txt").read_text()
    for package, oldest in (("torch", OLDEST_TORCH), ("torchvision", OLDEST_TORCHVISION)):
        assert re.search(rf"^{package}>={re.escape(versions.dotted(oldest))}$", requirements, re.MULTILINE), (
            f"requirements.txt must ask for {package}>={versions.dotted(oldest)}, the oldest release CI tests")


def test_ci_tests_the_oldest_pair_too() -> None:
    ci_lines = (REPO / ".ci" / "run").read_text().strip().splitlines()
    assert ".ci/oldest" in "\n".join(ci_lines[:-1]), "the last line of .ci/run stays the README's test command"


@pytest.mark.parametrize(("script", "package"), OLDER_PYTORCH)
def test_every_script_stops_in_one_line_on_an_older_pytorch(script: str, package: str, tmp_path: Path) -> None:
    """--help: were the check missing, the script would print its help and exit 0, doing no work either. The
    release is read from the package's version.py without importing it (torch takes seconds): the check is
    pointed at an older one's."""
    older = {"torch": "2.5.1", "torchvision": "0.20.1"}[package]
    fake = tmp_path / "older" / package
    fake.mkdir(parents=True)
    (fake / "version.py").write_text(f"__version__ = '{older}+cpu'\ngit_version = 'abc'\n")
    path = REPO / script
    # As `python SCRIPT --help` would run it (its folder first on sys.path), the older version.py found first.
    fake_older = ("import runpy, sys, types, importlib.util as util; found = util.find_spec; "
                  f"util.find_spec = lambda name, *a: types.SimpleNamespace(submodule_search_locations=[{str(fake)!r}])"
                  f" if name == {package!r} else found(name, *a); "
                  f"sys.argv = [{str(path)!r}, '--help']; sys.path.insert(0, {str(path.parent)!r}); "
                  f"runpy.run_path({str(path)!r}, run_name='__main__')")
    result = run([python(), "-c", fake_older], cwd=tmp_path, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stdout == "" and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("error: installed are torch ") and f"{package} {older}+cpu" in result.stderr


class RecordingGroup:
    def __init__(self) -> None:
        self.aborted = False

    def abort(self) -> None:
        self.aborted = True


def test_abort_uses_pytorchs_group_abort_where_it_exists(monkeypatch: pytest.MonkeyPatch) -> None:
    calls, world = [], RecordingGroup()
    monkeypatch.setattr(dist.distributed_c10d, "_abort_process_group", lambda: calls.append("all groups"),
                        raising=False)
    monkeypatch.setattr(dist, "group", SimpleNamespace(WORLD=world))
    abort_process_group()
    assert calls == ["all groups"] and not world.aborted


def test_without_the_private_abort_the_default_group_is_aborted_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    world = RecordingGroup()
    monkeypatch.delattr(dist.distributed_c10d, "_abort_process_group", raising=False)
    monkeypatch.setattr(dist, "group", SimpleNamespace(WORLD=world))
    abort_process_group()
    assert world.aborted


def test_the_flight_recorder_is_read_and_sized_through_the_name_each_release_has(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Releases with `_dump_fr_trace` read TORCH_FR_BUFFER_SIZE; before it, `_dump_nccl_trace` and the older
    variable; with neither, there is no record to read."""
    c10d = torch._C._distributed_c10d
    for name in ("_dump_fr_trace", "_dump_nccl_trace"):
        monkeypatch.delattr(c10d, name, raising=False)
    assert versions.flight_recorder_dump() is None
    assert versions.flight_recorder_size_variable() == "TORCH_NCCL_TRACE_BUFFER_SIZE"
    monkeypatch.setattr(c10d, "_dump_nccl_trace", lambda **kwargs: b"nccl's", raising=False)
    assert versions.flight_recorder_dump() == b"nccl's"
    monkeypatch.setattr(c10d, "_dump_fr_trace", lambda **kwargs: b"every backend's", raising=False)
    assert versions.flight_recorder_dump() == b"every backend's"
    assert versions.flight_recorder_size_variable() == "TORCH_FR_BUFFER_SIZE"


@pytest.mark.skipif(not hasattr(torch._C._distributed_c10d.ProcessGroup, "abort"),
                    reason="ProcessGroup.abort came with torch 2.7")
def test_the_abort_fallback_runs_on_a_real_group(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(dist.distributed_c10d, "_abort_process_group")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        abort_process_group()  # gloo has nothing in flight to end: this runs the call itself
    finally:
        dist.destroy_process_group()


def test_the_default_store_is_the_one_the_group_was_made_with() -> None:
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        assert versions.has_default_store()
        keys = store.num_keys()
        versions.default_store().set("processes_stopped", "1")  # under the group's own prefix
        assert store.num_keys() == keys + 1
    finally:
        dist.destroy_process_group()


def test_without_the_store_each_process_explains_and_a_time_out_stands_as_it_came(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """What a job without a process group does: nobody waits for a store, nobody stays quiet."""
    monkeypatch.delattr(dist.distributed_c10d, "_get_default_store", raising=False)
    monkeypatch.setattr(shutdown, "is_dist_avail_and_initialized", lambda: True)
    assert not versions.has_default_store()
    assert shutdown.first_to_stop() is True
    assert shutdown.another_process_failed() is False
    assert shutdown.collective_failure(RuntimeError("Timed out waiting 5000ms"), 1) is None
    # A lost peer is still named as such, without guessing that it was the store's keeper.
    lost = str(shutdown.collective_failure(RuntimeError("Connection closed by peer [10.0.0.2]:4242"), 1))
    assert lost.startswith("rank 1 lost its connection to another process (at 10.0.0.2"), lost


@pytest.mark.parametrize(("flags", "expected"), [
    ({"avx512_bf16": True, "amx_tile": False}, True), ({"avx512_bf16": False, "amx_tile": True}, True),
    ({"avx512_bf16": False, "amx_tile": False}, False), ({"architecture": "arm64"}, False)])
def test_bf16_cpus_are_found_by_pytorchs_public_capabilities(
        monkeypatch: pytest.MonkeyPatch, flags: dict[str, object], expected: bool) -> None:
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: flags, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: not expected, raising=False)
    assert cpu_has_bf16() is expected


@pytest.mark.parametrize(("avx512_bf16", "amx_tile"), [(True, False), (False, True), (False, False)])
def test_before_the_public_capabilities_the_private_checks_find_them(
        monkeypatch: pytest.MonkeyPatch, avx512_bf16: bool, amx_tile: bool) -> None:
    monkeypatch.delattr(torch.cpu, "get_capabilities", raising=False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx_tile, raising=False)
    assert cpu_has_bf16() is (avx512_bf16 or amx_tile)


@pytest.mark.skipif(not Path("/proc/cpuinfo").is_file(), reason="reads the CPU flags Linux reports")
def test_bf16_is_found_on_the_cpus_that_have_it() -> None:
    """The real call on this machine, checked against the flags Linux reports for its CPU."""
    flags = set(re.findall(r"\S+", re.search(r"^flags\s*:(.*)$", Path("/proc/cpuinfo").read_text(), re.M)[1]))
    assert cpu_has_bf16() is bool(flags & {"avx512_bf16", "amx_tile"})


def test_the_compiled_wrapper_gives_back_the_model_and_a_plain_model_is_itself() -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    assert unwrap_model(model) is model
    compiled = torch.compile(model)  # compiles on the first call only: nothing is compiled here
    assert unwrap_model(compiled) is model
    assert set(unwrap_model(compiled).state_dict()) == {"0.weight", "0.bias"}
