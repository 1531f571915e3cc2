"""The README and the pages of docs/, checked as a newcomer would use them: their commands run, their
examples print what they say, their links to our code point at the line they name, their diffs are the
scripts' real lines, their pictures exist.

A page whose commands rot fails here: each command of a ```bash block runs as written, README first, then
the pages of docs/ by name, in one scratch folder (so a later command finds what an earlier one wrote), with
the tiny sizes of TINY_OVERRIDES appended (later flags win in argparse). Commands that cannot run here are
listed in NOT_RUN with the reason; any other command that is not understood fails the test. The recipes of
the README's "Change it" are run by test_change_it.py, each on a copy with its change applied.
"""

from __future__ import annotations

import doctest
import re
import shlex
import sys
from pathlib import Path

import pytest

from conftest import REPO, TINY_FLAGS, free_port, make_image_folder, run, script_env

pytestmark = pytest.mark.docs

README = REPO / "README.md"
PAGES = [README, *sorted((REPO / "docs").glob("*.md"))]
# The recipes of docs/change-it.md are run by test_change_it.py, each on a copy with its change applied.
COMMAND_PAGES = [page for page in PAGES if page.name != "change-it.md"]
TEXTS = {page: page.read_text() for page in PAGES}
TEXT = TEXTS[README]
MAX_README_WORDS = 5000

# Commands not run here, matched against the command as written, and why. Keep this list short and honest.
NOT_RUN = [
    (r"^python3 -m venv |^\. \.venv/bin/activate$|^pip install",
     "set-up: makes a venv and downloads packages (test_the_test_command_is_what_ci_runs checks it)"),
    (r"^ruff check", "CI runs it itself, in .ci/run"),
    (r"^python -m pytest", "the test suite itself"),
    (r"^CUDA_VISIBLE_DEVICES=", "needs two GPUs"),
    (r"--syncBN|--prefix syncbn_", "the SyncBN comparison needs GPUs: PyTorch's SyncBatchNorm refuses CPU modules"),
    (r"--nnodes=", "needs a second machine: tests/test_two_hosts.py runs the two-machine command across two "
                   "hosts in network namespaces, tests/test_elastic.py the elastic one with two agents"),
    (r"two_hosts_benchmark\.py", "needs root and network namespaces: tests/test_two_hosts.py runs it"),
    (r"^tensorboard ", "starts a web server; test_recorder.py reads the same events with TensorBoard's reader"),
    (r"resnet34-333f7ec4\.pth", "needs the flower_photos data set and ImageNet weights (downloads)"),
    (r"--output-dir runs/disagree", "waits --dist-timeout by design, once docs/failures.md's change is made: "
                                    "tests/test_hangs.py applies that change and runs it"),
]

# Appended to each command of a script, to keep the run tiny; "{data}" is a small image folder, used instead
# of the demo data (600 images) to save time. A script missing here fails the test: add it.
TRAIN_TINY = ["--data-path", "{data}", *TINY_FLAGS]
TINY_OVERRIDES = {
    "train_single_gpu.py": TRAIN_TINY,
    "train_multi_gpu_using_launch.py": TRAIN_TINY,
    "train_multi_gpu_using_spawn.py": TRAIN_TINY,
    "show_batch.py": ["--data-path", "{data}", "--image-size", "16", "--batch-size", "4"],
    "plot_runs.py": [],
    "bench/benchmark.py": ["--model", "resnet18", "--image-size", "16", "--batch-size", "2", "--steps", "2",
                           "--warmup-steps", "1", "--repeats", "1", "--rounds", "1"],
    "bench/peers_benchmark.py": ["--data-path", "{data}", "--rounds", "1", "--epochs", "1", "--image-size", "16",
                                 "--batch-size", "4", "--workers", "0"],
    "bench/plot_benchmark.py": [],
    "bench/gpu_check.py": [],  # without a GPU: one line, exit 0
    "predict.py": [],  # on the run an earlier command trained; the demo images replaced, below
}
# Demo images named in README commands (predict.py's): the small image folder stands in for them here.
DEMO_IMAGES = "data/demo_patterns"
COMMAND_TIMEOUT_S = 150


def fenced_blocks(language: str, text: str = TEXT) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", text, flags=re.DOTALL | re.MULTILINE)


def commands_of(block: str) -> list[str]:
    """The commands of a bash block: continuation lines joined, comment lines dropped, && split."""
    commands = []
    for line in block.replace("\\\n", " ").splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            commands += [" ".join(part.split()) for part in line.split("&&")]
    return commands


def readme_commands() -> list[str]:
    """Every command of every page's bash blocks, in page order; but batch scripts (test_slurm.py runs those), and
    the recipes of Change it (test_change_it.py runs each on a copy with its change applied)."""
    texts = [TEXTS[page] for page in COMMAND_PAGES]
    return [command for text in texts for block in fenced_blocks("bash", text)
            if not block.startswith("#!/") for command in commands_of(block)]


COMMANDS = readme_commands()
# The benchmarks' own commands run under the marker `benchmarks`, which .ci/run runs after the test command.
BENCHMARK_COMMAND = re.compile(r"bench/\w*benchmark\.py")


def with_marks(command: str) -> pytest.param:
    marks = [pytest.mark.benchmarks] if BENCHMARK_COMMAND.search(command) else [pytest.mark.commands]
    return pytest.param(command, id=command, marks=marks)


def reason_not_run(command: str) -> str | None:
    return next((why for pattern, why in NOT_RUN if re.search(pattern, command)), None)


def to_argv(command: str, data: Path) -> tuple[list[str], dict[str, str]]:
    """The command as a subprocess argv and environment: our Python for `python` and `torchrun`, scripts by
    their path in the repository, ports replaced by free ones on 127.0.0.1, tiny sizes appended."""
    words = shlex.split(command, comments=True)
    env = script_env()
    while words and re.fullmatch(r"[A-Z_]+=.*", words[0]):
        name, value = words.pop(0).split("=", 1)
        env[name] = str(free_port()) if name == "MASTER_PORT" else value
    program, *args = words
    if program in ("python", "python3"):
        argv = [sys.executable]
    elif program == "torchrun":
        argv = [sys.executable, "-m", "torch.distributed.run"]
    else:
        raise AssertionError(f"README command {command!r}: unknown program {program!r}; run it here or add it "
                             "to NOT_RUN with the reason")
    # Launchers without --standalone read their port from PET_MASTER_PORT; the README's may be in use here.
    env["PET_MASTER_PORT"] = str(free_port())
    scripts = [arg for arg in args if arg.endswith(".py")]
    if not scripts:
        raise AssertionError(f"README command {command!r} names no script")
    script = scripts[0]
    if script not in TINY_OVERRIDES:
        raise AssertionError(f"README command {command!r}: add {script} to TINY_OVERRIDES")
    assert (REPO / script).is_file(), f"README command {command!r}: {script} does not exist"
    args = [str(REPO / arg) if arg == script else arg for arg in args]
    args = [f"--master_port={free_port()}" if arg.startswith(("--master_port=", "--master-port=")) else arg
            for arg in args]
    args = [str(data) if arg.startswith(DEMO_IMAGES) else arg for arg in args]
    tiny = [flag.format(data=data) for flag in TINY_OVERRIDES[script]]
    return [*argv, *args, *tiny], env


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The folder every command runs in, and a small image folder (3 classes of 10 images)."""
    root = tmp_path_factory.mktemp("readme")
    return root / "work", make_image_folder(root / "images", {"red": 10, "green": 10, "blue": 10})


@pytest.mark.slow
@pytest.mark.parametrize("command", [with_marks(command) for command in COMMANDS])
def test_readme_command_runs(command: str, scratch: tuple[Path, Path]) -> None:
    why = reason_not_run(command)
    if why:
        pytest.skip(why)
    work, data = scratch
    work.mkdir(exist_ok=True)
    argv, env = to_argv(command, data)
    result = run(argv, timeout=COMMAND_TIMEOUT_S, cwd=work, env=env)
    assert result.returncode == 0, (f"README command {command!r} failed (exit {result.returncode})\n"
                                    f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}")


def test_the_readme_has_commands_to_run() -> None:
    runnable = [command for command in COMMANDS if not reason_not_run(command)]
    assert any("train_single_gpu.py" in c for c in runnable) and any("torchrun" in c for c in runnable)
    assert any("plot_runs.py" in c for c in runnable)


def test_the_test_command_is_what_ci_runs() -> None:
    """.ci/run runs the README's test command as it is, and then each group of tests it leaves out (the
    markers that pyproject.toml's addopts deselect), as the README says."""
    ci_lines = (REPO / ".ci" / "run").read_text().strip().splitlines()
    readme_lines = [line for block in fenced_blocks("bash") for line in block.splitlines()]
    (test_command,) = [line for line in readme_lines if line.endswith("python -m pytest")]
    addopts = re.search(r'^addopts = "(.*)"', (REPO / "pyproject.toml").read_text(), re.MULTILINE).group(1)
    left_out = re.findall(r"not (\w+)", addopts)
    assert left_out, "the test command leaves nothing out"
    after = [line.split("  #")[0] for line in ci_lines[ci_lines.index(test_command) + 1:]]
    assert after == [f"python -m pytest -m {marker}" for marker in left_out]
    for marker in left_out:
        assert f"`python -m pytest -m {marker}`" in " ".join(TEXT.split()), f"the README does not say -m {marker}"


@pytest.mark.commands
def test_the_test_command_collects_every_test_without_the_optional_plotting_packages(tmp_path: Path) -> None:
    """matplotlib is optional (requirements-plot.txt): without it the suite still collects, and only the tests of
    the pictures skip."""
    blocked = tmp_path / "no_matplotlib"
    blocked.mkdir()
    (blocked / "matplotlib.py").write_text("raise ModuleNotFoundError('No module named matplotlib')\n")
    collected = run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "", "-p", "no:cacheprovider"],
                    env=script_env(PYTHONPATH=f"{blocked}:{REPO}"), timeout=300)
    assert collected.returncode == 0, collected.stdout[-3000:] + collected.stderr[-3000:]
    assert re.search(r"^\d+ tests collected", collected.stdout, re.MULTILINE), collected.stdout[-500:]
    skipped = run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_plot_runs.py",
                   "tests/test_benchmark.py::test_the_picture_is_drawn_from_result_files"],
                  env=script_env(PYTHONPATH=f"{blocked}:{REPO}"), timeout=300)
    assert skipped.returncode == 0 and re.search(r"\d+ skipped", skipped.stdout), skipped.stdout[-2000:]


def test_readme_examples_print_what_it_says() -> None:
    # The >>> examples of the ```python blocks, without the closing fences (doctest would expect them as output).
    blocks = [block for page in PAGES for block in fenced_blocks("python", TEXTS[page])]
    examples = doctest.DocTestParser().get_doctest("\n\n".join(blocks), {}, "README.md", str(README), 0)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    runner.run(examples)
    result = runner.summarize(verbose=False)
    assert result.attempted > 0 and result.failed == 0


def test_the_parts_generated_from_the_code_are_up_to_date() -> None:
    """The README's loop and script diffs and docs/flags.md's table are written from the code by
    docs/generate.py: after a change to the code, one line says to run it."""
    sys.path.insert(0, str(REPO / "docs"))
    import generate

    assert generate.stale_parts() == []


def prose(text: str) -> str:
    return re.sub(r"<!-- generated: .*?<!-- end generated -->", "", text, flags=re.DOTALL)


def test_the_same_lines_added_to_every_script_leave_the_generated_diffs_as_they_were(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A change made alike to the three scripts (a criterion, an import, a call) moves the diff's lines, not its
    text: the README's copy stays up to date."""
    sys.path.insert(0, str(REPO / "docs"))
    import generate

    parts = re.findall(r"<!-- generated: (diff .+?) -->", TEXT)
    assert parts, "the README shows the diffs between the scripts"
    before = {part: generate.generated(part) for part in parts}
    for script in ("train_single_gpu.py", "train_multi_gpu_using_launch.py", "train_multi_gpu_using_spawn.py"):
        text = (REPO / script).read_text()
        added = "    print('one line more')\n    print('and another')\n"
        text = text.replace("def main(args: RunConfig) -> None:\n", "def main(args: RunConfig) -> None:\n" + added)
        text = text.replace("\nif __name__", "\n\ndef also() -> None:\n    pass\n\nif __name__")
        (tmp_path / script).write_text(text)
    monkeypatch.setattr(generate, "REPO", tmp_path)
    assert {part: generate.generated(part) for part in parts} == before


def test_the_readme_is_read_in_one_sitting_and_links_every_page_of_docs() -> None:
    words = len(prose(TEXT).split())
    assert words <= MAX_README_WORDS, f"README.md has {words} words (its generated parts aside): move some to docs/"
    assert len(TEXT.split()) <= MAX_README_WORDS, "README.md, its generated parts too, is more than one sitting"
    sections = re.findall(r"^## (.+)$", TEXT, re.MULTILINE)
    assert sections.index("From one process to many") == 1 < sections.index("Tests"), (
        "a newcomer meets the lesson right after the set-up, and how the tests are grouped only after it")
    linked = set(re.findall(r"\]\((docs/[\w.-]+\.md)", TEXT))
    assert linked == {f"docs/{page.name}" for page in PAGES[1:]}, "README.md's table of docs/ pages is out of date"


CODE_LINK = re.compile(r"\[`([^`]+)`\]\(([^)#\s]+\.py)\)")


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_links_to_our_code_name_what_is_there(page: Path) -> None:
    """A link to our code names a function, class or line of it, and goes to its file (no line numbers, which
    move whenever a line is added above)."""
    for symbol, path in CODE_LINK.findall(TEXTS[page]):
        name = re.split(r"[(\s]", symbol.split(".")[-1])[0] if "(" not in symbol else symbol.split("(")[0]
        code = (page.parent / path).read_text()
        assert name in code, f"{page.name}: [`{symbol}`]({path}): {path} no longer holds {name!r}; update the link"
    assert not re.search(r"\.py#L\d+\)", TEXTS[page]), f"{page.name}: a link to a line number; link the file"


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    prose = re.sub(r"^```.*?^```", "", TEXTS[page], flags=re.DOTALL | re.MULTILINE)  # a "# comment" is no heading
    return {github_anchor(heading) for heading in re.findall(r"^#+ (.+)$", prose, flags=re.MULTILINE)}


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_local_links_pictures_and_headings_exist(page: Path) -> None:
    """Every link to a file of the repository finds it, and a link to a heading (#...), on the same page or
    another, finds the heading."""
    for target in re.findall(r"\]\(([^)\s]+)\)", TEXTS[page]):
        if target.startswith(("http://", "https://")):
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        assert linked.exists(), f"{page.name} links to {path}, which does not exist"
        if anchor and linked.suffix == ".md":
            assert anchor in anchors(linked), f"{page.name}: no heading #{anchor} in {linked.name}"


def test_the_commands_a_learner_copies_write_outside_the_tracked_files_and_never_into_each_others_runs() -> None:
    """Copied in order from a fresh clone, no command overwrites docs/ or stops at a folder an earlier one filled."""
    fresh = [command for command in COMMANDS if re.search(r"train_\w+\.py", command)
             and "--resume" not in command and "--eval-only" not in command]
    folders = [found[1] if (found := re.search(r"--output-dir (\S+)", command)) else "output" for command in fresh]
    assert len(folders) == len(set(folders)), folders
    assert not [command for command in COMMANDS if re.search(r"--out(-dir)? docs\b", command)]


def test_the_readme_answers_a_newcomers_first_questions_where_they_arise() -> None:
    """How to install without several GB of CUDA libraries (in PyTorch's own terms), and what torchrun's warning
    about OMP_NUM_THREADS means, where the README first starts torchrun."""
    flat = " ".join(TEXT.split())
    assert "pip install torch torchvision --index-url https://download.pytorch.org/whl/cpu" in flat
    starting = " ".join(TEXT.split("## Two ways to start processes")[1].split("\n## ")[0].split())
    assert "torchrun starts by warning that it sets `OMP_NUM_THREADS=1` for each process: harmless" in starting
