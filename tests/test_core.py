"""A core you can see and change: the step a few calls from main(), mp.spawn in the spawn script itself, nothing
running that was not asked for, an engine that imports nothing of the application, installs, and trains a
script of your own."""

from __future__ import annotations

import ast
import importlib.util
import inspect
import json
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.data import DataLoader, TensorDataset

import multi_train_utils
import train_multi_gpu_using_launch
import train_single_gpu
from conftest import REPO, TINY_FLAGS, free_port, python, run, script_env, torchrun
from multi_train_utils.cli import parse_args
from multi_train_utils.distributed_utils import init_distributed_mode
from multi_train_utils.train_eval_utils import train_one_epoch

_spec = importlib.util.spec_from_file_location("lines_below_main", REPO / "bench" / "lines_below_main.py")
lines_below_main = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lines_below_main)

MAX_OWN_FRAMES = 4  # from the entry script's own function down to the one that calls optimizer.step()
MAX_LOOP_LINES = 60
LESSON_FILES = {"distributed_utils.py": 250, "train_eval_utils.py": 300}  # lines, at most
SCREEN = 30  # lines
# Issue 38: below main(), at most (lines, files); spawn's main also starts the processes
BELOW_MAIN = {"train_single_gpu.py": (250, 8), "train_multi_gpu_using_launch.py": (250, 8),
              "train_multi_gpu_using_spawn.py": (350, 10)}
ENGINE = REPO / "multi_train_utils"
APPLICATION = {path.stem for path in REPO.glob("*.py")}
OPTIONAL_FEATURES = ["ema", "periodic_checkpoints", "freezing", "gpu_decode", "pictures"]
# The repository's modules that every run needs: any other that a run with default flags imports is a feature
# imported whether it is asked for or not.
EVERY_RUN = {"model", "my_dataset", "utils", "multi_train_utils", *(f"multi_train_utils.{name}" for name in (
    "checkpoint", "cli", "config", "confusion", "data", "distributed_utils", "errors", "features", "files",
    "flight_recorder", "launch", "meeting", "optim", "recorder", "shutdown", "train_eval_utils", "versions"))}


def own_frames(frames: list[inspect.FrameInfo], entry: str) -> list[str]:
    """The repository's functions on a stack, from the function `entry` (file:function) down."""
    own = [f"{Path(frame.filename).relative_to(REPO)}:{frame.function}" for frame in reversed(frames)
           if Path(frame.filename).is_relative_to(REPO)
           and Path(frame.filename).relative_to(REPO).parts[0] not in (".venv", "tests")]
    return own[own.index(entry):]


def frames_at_the_first_step(script: object, launcher: str, data: Path, out: Path) -> list[str]:
    stacks: list[list[inspect.FrameInfo]] = []

    def record(*_: object) -> None:
        if not stacks:
            stacks.append(inspect.stack())

    handle = register_optimizer_step_pre_hook(record)
    try:
        script.main(parse_args(launcher, ["--data-path", str(data), "--output-dir", str(out), *TINY_FLAGS]))
    finally:
        handle.remove()
    return own_frames(stacks[0], f"{Path(script.__file__).name}:main")


def test_the_first_optimizer_step_is_a_few_calls_from_main(image_folder: Path, tmp_path: Path) -> None:
    single = frames_at_the_first_step(train_single_gpu, "single", image_folder, tmp_path / "single")
    assert single == ["train_single_gpu.py:main", "multi_train_utils/train_eval_utils.py:fit",
                      "multi_train_utils/train_eval_utils.py:train_one_epoch"]
    launch = frames_at_the_first_step(train_multi_gpu_using_launch, "launch", image_folder, tmp_path / "launch")
    assert launch == ["train_multi_gpu_using_launch.py:main", "train_multi_gpu_using_launch.py:train",
                      "multi_train_utils/train_eval_utils.py:fit",
                      "multi_train_utils/train_eval_utils.py:train_one_epoch"]
    assert max(len(single), len(launch)) <= MAX_OWN_FRAMES


@pytest.mark.slow
def test_the_spawn_script_calls_mp_spawn_and_its_workers_are_three_calls_from_the_step(
        image_folder: Path, tmp_path: Path) -> None:
    """mp.spawn on the page: the script's main() calls torch.multiprocessing.spawn itself, with the function each
    process runs; from that function down to the step, three more of the repository's functions."""
    spawn = (REPO / "train_multi_gpu_using_spawn.py").read_text()
    main = next(node for node in ast.parse(spawn).body if isinstance(node, ast.FunctionDef) and node.name == "main")
    assert "mp.spawn(worker, args=(world_size, args), nprocs=world_size" in ast.get_source_segment(spawn, main)
    probe = (f"import sys, inspect, json; sys.path[:0] = [{str(REPO)!r}, {str(REPO / 'tests')!r}]\n"
             "from torch.optim.optimizer import register_optimizer_step_pre_hook\n"
             "import test_core, train_multi_gpu_using_spawn as script\n"
             "seen = []\n"
             "def record(*_):\n"
             "    if not seen:\n"
             "        seen.append(1)\n"
             "        print('FRAMES', json.dumps(test_core.own_frames(inspect.stack(), "
             "'train_multi_gpu_using_spawn.py:worker')), flush=True)\n"
             "register_optimizer_step_pre_hook(record)\n"
             "from multi_train_utils.cli import parse_args\n"
             "args = parse_args('spawn', sys.argv[1:])\n"
             "script.worker(int(__import__('os').environ['RANK']), 1, args)\n")
    result = run([python(), "-c", probe, "--data-path", str(image_folder), "--output-dir", str(tmp_path / "run"),
                  *TINY_FLAGS], env=script_env(RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())))
    assert result.returncode == 0, result.stderr[-3000:]
    frames = json.loads(result.stdout.split("FRAMES ", 1)[1].splitlines()[0])
    assert frames == ["train_multi_gpu_using_spawn.py:worker", "train_multi_gpu_using_spawn.py:train",
                      "multi_train_utils/train_eval_utils.py:fit",
                      "multi_train_utils/train_eval_utils.py:train_one_epoch"]


def test_the_loop_with_its_step_fits_on_one_screen() -> None:
    assert len(inspect.getsource(train_one_epoch).splitlines()) <= MAX_LOOP_LINES


def test_the_lesson_is_two_short_files_that_show_it_in_their_first_screen() -> None:
    """As in the tutorial: distributed_utils.py and train_eval_utils.py, each read in one sitting, and what the
    lesson is about in sight at once: init_process_group in init_distributed_mode, the backward pass (where DDP
    averages the gradients) and the optimizer step in train_one_epoch. The rest stands beside them."""
    for name, most in LESSON_FILES.items():
        assert len((ENGINE / name).read_text().splitlines()) <= most, f"{name}: longer than {most} lines"
    joining = inspect.getsource(init_distributed_mode).splitlines()[:SCREEN]
    assert any("dist.init_process_group(" in line for line in joining)
    loop = inspect.getsource(train_one_epoch).splitlines()[:SCREEN]
    assert any(".backward()" in line for line in loop) and any(".step(optimizer)" in line for line in loop)


def test_one_level_below_main_is_short_and_in_few_files() -> None:
    """What a reader follows below each script's main() (bench/lines_below_main.py): main, what it calls, fit and
    train_one_epoch, in about as many lines and files as the anchors' whole training code."""
    for script, (most_lines, most_files) in BELOW_MAIN.items():
        counted = lines_below_main.below_main(REPO / script)
        assert counted["lines"] <= most_lines and counted["files"] <= most_files, f"{script}: {counted}"


def test_lines_below_main_counts_main_what_it_calls_and_the_loop(tmp_path: Path) -> None:
    engine = tmp_path / "multi_train_utils"
    engine.mkdir()
    (engine / "train_eval_utils.py").write_text("def fit():\n    train_one_epoch()\n\n\n"
                                                "def train_one_epoch():\n    pass\n")
    (engine / "run.py").write_text("class Run:\n    def __init__(self):\n        pass\n\n"
                                   "    def __enter__(self):\n        return self\n\n"
                                   "    def unused(self):\n        pass\n\n\n"
                                   "def helper(x):\n    # one line more\n    return x\n\n\n"
                                   "def never_called():\n    pass\n")
    script = tmp_path / "script.py"
    script.write_text("from multi_train_utils.run import Run, helper\n"
                      "from multi_train_utils.train_eval_utils import fit\n\n\n"
                      "def main():\n    with Run():\n        train(helper(1))\n\n\n"
                      "def train(x):\n    fit()\n")
    counted = lines_below_main.below_main(script, tmp_path)
    # main 3, train 2, Run.__init__ 2, Run.__enter__ 2, helper 3, fit 2, train_one_epoch 2
    assert (counted["lines"], counted["files"]) == (16, 3), counted["functions"]
    assert not any("unused" in name or "never_called" in name for name in counted["functions"])


def test_the_loop_runs_with_no_hook_attached_and_the_loss_it_is_given() -> None:
    """The tutorial's call, with the criterion as torchvision's references pass it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(12, 3))
    before = model[1].weight.detach().clone()
    loader = DataLoader(TensorDataset(torch.randn(8, 3, 2, 2), torch.randint(0, 3, (8,))), batch_size=4)
    losses = []

    def criterion(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        losses.append(1)
        return nn.functional.cross_entropy(logits, labels)

    loss = train_one_epoch(model, criterion, torch.optim.SGD(model.parameters(), lr=0.1), loader,
                           torch.device("cpu"), 0)
    assert loss > 0 and not torch.equal(before, model[1].weight) and len(losses) == 2


def engine_imports() -> list[str]:
    """Every import in the engine's source (at the top or inside a function), as "module: imported"."""
    found = []
    for path in ENGINE.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found += [f"{path.stem}: {alias.name}" for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                found.append(f"{path.stem}: {'.' * node.level}{node.module or ''}")
    return found


def test_the_engine_imports_nothing_of_the_application_and_no_module_imports_its_importer() -> None:
    upward = [line for line in engine_imports() if line.split(": ")[1].split(".")[0] in APPLICATION]
    assert upward == [], "the scripts hand the engine what it needs"
    graph: dict[str, set[str]] = {}
    for line in engine_imports():
        module, imported = line.split(": ")
        if imported.startswith(".") and imported.strip("."):
            graph.setdefault(module, set()).add(imported.strip(".").split(".")[0])

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        return any(next_ == goal or (next_ not in seen and reaches(next_, goal, seen | {next_}))
                   for next_ in graph.get(start, ()))

    assert [module for module in graph if reaches(module, module, {module})] == [], "an import circle"


def test_what_is_not_asked_for_is_not_imported(image_folder: Path, tmp_path: Path) -> None:
    """A run with default flags imports none of the optional features' modules (nor the code that draws, which
    runs once the first epoch ends); with their flags, it does."""
    probe = (f"import sys, runpy; sys.path.insert(0, {str(REPO)!r}); sys.argv = sys.argv[1:]\n"
             "from torch.optim.optimizer import register_optimizer_step_pre_hook\n"
             "def stop(*_):\n"
             f"    own = [name for name, module in sys.modules.items() if name != '__main__' and (getattr(module, "
             f"'__file__', None) or '').startswith({str(REPO) + '/'!r}) and '/.venv/' not in module.__file__]\n"
             "    print('MODULES', sorted(own), flush=True)\n"
             "    raise SystemExit(0)\n"
             "register_optimizer_step_pre_hook(stop)\n"
             "runpy.run_path(sys.argv[0], run_name='__main__')\n")
    flags = ["--data-path", str(image_folder), *TINY_FLAGS]
    plain = run([python(), "-c", probe, str(REPO / "train_single_gpu.py"), *flags, "--output-dir", str(tmp_path / "a")])
    imported = plain.stdout.split("MODULES ", 1)[1]
    assert [feature for feature in OPTIONAL_FEATURES if f"multi_train_utils.{feature}'" in imported] == [], imported
    unasked = sorted(set(ast.literal_eval(imported.splitlines()[0])) - EVERY_RUN)
    assert unasked == [], (f"{unasked}: imported by a run with default flags; import a feature where its flag is on "
                           "(features.attach), or add the module to EVERY_RUN if every run needs it")
    asked = run([python(), "-c", probe, str(REPO / "train_single_gpu.py"), *flags, "--output-dir", str(tmp_path / "b"),
                 "--model-ema", "--checkpoint-every-steps", "5", "--freeze-layers"])
    imported = asked.stdout.split("MODULES ", 1)[1]
    assert all(f"multi_train_utils.{feature}'" in imported for feature in ("ema", "periodic_checkpoints", "freezing"))


@pytest.mark.docs
def test_each_module_of_the_engine_is_listed_with_its_concern() -> None:
    """The package's docstring names every module once, with the concern it holds."""
    listed = multi_train_utils.__doc__
    modules = sorted(path.stem for path in ENGINE.glob("*.py") if path.stem != "__init__")
    missing = [module for module in modules if not re.search(rf"\b{module}\b", listed)]
    assert missing == [], f"multi_train_utils/__init__.py's docstring lacks {missing}: add each, with its concern"


@pytest.mark.slow
@pytest.mark.commands  # the docs' `pip install -e .`, as CI's commands group runs it: a wheel built and installed
def test_the_engine_installs_and_trains_a_script_of_your_own(tmp_path: Path) -> None:
    """examples/your_own_script.py: its own model, data and loss, fit() without a run folder, on one process and
    on two; with the engine installed as a wheel puts it, not from the checkout."""
    # Built from a copy: a build writes build/ and an .egg-info beside its sources, and the checkout may be read-only.
    sources = tmp_path / "sources"
    shutil.copytree(REPO / "multi_train_utils", sources / "multi_train_utils",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "requirements.txt"):
        shutil.copy(REPO / name, sources / name)
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                            str(tmp_path / "wheel"), str(sources)], capture_output=True, text=True, timeout=240)
    assert built.returncode == 0, built.stderr
    (wheel,) = (tmp_path / "wheel").glob("*.whl")
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(tmp_path / "site")
        tops = {name.split("/")[0] for name in archive.namelist()}
        assert {top for top in tops if not top.endswith(".dist-info")} == {"multi_train_utils"}, "the engine alone"
    script = tmp_path / "mine.py"
    script.write_text((REPO / "examples" / "your_own_script.py").read_text())
    env = script_env(PYTHONPATH=str(tmp_path / "site"))
    for start in ([python()], [*torchrun(), "--standalone", "--nproc_per_node=2"]):
        result = run([*start, str(script)], cwd=tmp_path, env=env, timeout=120)
        assert result.returncode == 0, result.stderr[-3000:]
        right = re.search(r"validation: (\d+) of 128 right", result.stdout)
        assert right and int(right[1]) > 100, result.stdout[-2000:]
    written = sorted(path.name for path in tmp_path.iterdir())
    assert written == ["mine.py", "site", "sources", "wheel"], "nothing written beside them"
