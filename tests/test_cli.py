"""The command line: the tutorial's flags, booleans that mean what they say, ranges checked."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from torch.utils.data import DataLoader

from conftest import TINY_FLAGS, run_single_in_this_process
from multi_train_utils import shutdown
from multi_train_utils.cli import DATA_DEFAULTS, DEMO_DEFAULTS, get_args_parser, parse_args, run_cli
from multi_train_utils.errors import UserInputError, one_line
from my_dataset import MyDataSet, UnreadableImageError, collate_fn

TUTORIAL_FLAGS = ["--num_classes", "--epochs", "--batch-size", "--lr", "--lrf", "--data-path", "--weights",
                  "--freeze-layers", "--device"]
OUR_FLAGS = ["--output-dir", "--seed", "--workers", "--image-size", "--model"]


@pytest.mark.parametrize("launcher", ["single", "launch", "spawn"])
def test_every_script_has_the_tutorials_flags_with_help(launcher: str) -> None:
    parser = get_args_parser(launcher)
    actions = {option: action for action in parser._actions for option in action.option_strings}
    expected = TUTORIAL_FLAGS + OUR_FLAGS + ([] if launcher == "single" else ["--syncBN", "--dist-url"])
    expected += ["--world-size"] if launcher == "spawn" else []
    for flag in expected:
        assert flag in actions, flag
        assert actions[flag].help, flag


@pytest.mark.parametrize(("text", "value"), [("False", False), ("false", False), ("0", False), ("no", False),
                                             ("True", True), ("1", True), ("yes", True)])
def test_boolean_flags_mean_what_they_say(text: str, value: bool) -> None:
    args = parse_args("launch", ["--freeze-layers", text, "--syncBN", text])
    assert args.freeze_layers is value and args.syncBN is value


def test_boolean_flag_alone_means_true_and_absent_means_false() -> None:
    assert parse_args("launch", ["--syncBN"]).syncBN is True
    assert parse_args("launch", []).syncBN is False
    assert parse_args("single", ["--freeze-layers"]).freeze_layers is True


@pytest.mark.parametrize("zero", ["0", "0.0", "0.00", "0e0", "-0"])
def test_zero_is_zero_however_it_is_written(zero: str) -> None:
    args = parse_args("single", ["--weight-decay", zero, "--mixup-alpha", zero])
    assert (args.weight_decay, args.mixup_alpha) == (0.0, 0.0)


@pytest.mark.parametrize("argv", [["--batch-size", "0"], ["--epochs", "0"], ["--workers", "-1"],
                                  ["--image-size", "8"], ["--world-size", "0"], ["--lr", "-1"],
                                  ["--freeze-layers", "maybe"], ["--batch-size", "two"],
                                  # values Python parses that training cannot use: not finite, past what
                                  # NumPy seeds take, past any machine
                                  ["--lr", "inf"], ["--lr", "nan"], ["--lrf", "1.5"], ["--dist-timeout", "inf"],
                                  ["--bucket-cap-mb", "1e309"], ["--seed", "-1"], ["--seed", str(2**32)],
                                  ["--image-size", "100000"], ["--workers", "100000"], ["--accum-steps", "100000"],
                                  ["--epochs", str(10**12)], ["--batch-size", str(10**9)],
                                  # past what the arithmetic they feed holds
                                  ["--lr", "1e308"], ["--lr", "1e7"], ["--dist-timeout", "1e308"],
                                  ["--weight-decay", "1e300"], ["--weight-decay", "-0.1"], ["--stop-grace", "1e300"],
                                  ["--checkpoint-every-minutes", "1e300"], ["--clip-grad-norm", "1e300"],
                                  # short of what the program can use: too short to meet; a Beta that fails
                                  ["--dist-timeout", "0.001"], ["--cutmix-alpha", "1e-300"],
                                  ["--mixup-alpha", "1e-40"],
                                  # an empty path: a shell variable that is not set, as in --data-path "$DATA"
                                  ["--data-path", ""], ["--output-dir", " "], ["--resume", ""]])
def test_out_of_range_values_are_refused_naming_the_flag(argv: list[str], capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        run_cli(lambda args: pytest.fail("ran"), "spawn", argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: argument {argv[0]}") and err.count("\n") == 1, err


def test_defaults_depend_on_whether_the_demo_data_is_used() -> None:
    demo = parse_args("single", [])
    assert (demo.epochs, demo.image_size, demo.lr, demo.batch_size) == (
        DEMO_DEFAULTS["epochs"], DEMO_DEFAULTS["image_size"], DEMO_DEFAULTS["lr"], DEMO_DEFAULTS["batch_size"])
    own = parse_args("single", ["--data-path", "flowers", "--epochs", "3"])
    assert (own.epochs, own.image_size, own.lr) == (3, DATA_DEFAULTS["image_size"], DATA_DEFAULTS["lr"])


def test_legacy_launcher_local_rank_argument_is_accepted() -> None:
    assert parse_args("launch", ["--local-rank=1"]).local_rank == 1
    assert parse_args("launch", ["--local_rank", "0"]).local_rank == 0


def test_one_line_takes_the_original_message_out_of_a_data_loader_worker(tmp_path: Path) -> None:
    broken = tmp_path / "broken.jpg"
    broken.write_bytes(b"not a jpeg")
    loader = DataLoader(MyDataSet([str(broken)], [0]), num_workers=1, collate_fn=collate_fn)
    with pytest.raises(UnreadableImageError) as caught:
        next(iter(loader))
    assert "Traceback" in str(caught.value)  # what the worker sends back: its whole traceback
    assert one_line(caught.value).startswith(f"cannot read image {broken}: ")
    assert "\n" not in one_line(caught.value)
    assert one_line(ValueError("plain")) == "plain"


def test_syncbn_with_compile_is_refused_in_one_line() -> None:
    """torch.compile breaks its graph at every SyncBatchNorm layer."""
    with pytest.raises(UserInputError, match=r"^--syncBN with --compile"):
        parse_args("launch", ["--syncBN", "--compile"])
    assert parse_args("launch", ["--syncBN", "false", "--compile"]).compile


@pytest.mark.parametrize(("argv", "start"), [
    (["--warmup-epochs", "5", "--epochs", "5"], "error: --warmup-epochs 5: must be fewer than --epochs 5"),
    (["--dist-url", "localhost:1234"], "error: --dist-url localhost:1234: expected env://"),
    (["--sched", "constant", "--lrf", "0.5"], "error: --lrf 0.5: the final lr of --sched cosine"),
])
def test_flags_that_do_not_go_together_are_one_line(argv: list[str], start: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        run_cli(lambda args: pytest.fail("ran"), "spawn", argv)
    assert stop.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(start), line


def test_under_a_launcher_only_rank_0_reports_a_bad_flag(monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """torchrun starts N processes that each parse the same flags: one line, not N."""
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(shutdown, "QUIET_EXIT_DELAY_S", 0.0)
    with pytest.raises(SystemExit) as stop:
        run_cli(lambda args: pytest.fail("ran"), "launch", ["--epochs", "0"])
    assert stop.value.code == 2 and capsys.readouterr().err == ""


@pytest.mark.parametrize(("launcher", "script"), [
    ("single", "train_single_gpu.py trains in one process"),
    ("spawn", "train_multi_gpu_using_spawn.py starts its processes itself")])
@pytest.mark.parametrize(("env", "by"), [({"RANK": "{rank}", "WORLD_SIZE": "2"}, "torchrun"),
                                         ({"SLURM_PROCID": "{rank}", "SLURM_STEP_NUM_TASKS": "2"}, "srun")])
def test_a_door_started_by_the_wrong_launcher_says_so_in_one_line_at_once(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], launcher: str, script: str,
        env: dict[str, str], by: str) -> None:
    monkeypatch.setattr(shutdown, "QUIET_EXIT_DELAY_S", 0.0)
    for rank in (0, 1):
        for name, value in env.items():
            monkeypatch.setenv(name, value.format(rank=rank))
        with pytest.raises(SystemExit) as stop:
            run_cli(lambda args: pytest.fail("ran"), launcher, [])
        said = capsys.readouterr().err
        assert stop.value.code == 2
        assert said == (f"error: {script}, but {by} started it as one of 2: start train_multi_gpu_using_launch.py "
                        f"with {by} instead\n" if rank == 0 else ""), said


@pytest.mark.parametrize("launcher", ["single", "launch", "spawn"])
def test_help_names_each_default_once(launcher: str) -> None:
    for action in get_args_parser(launcher)._actions:
        text = get_args_parser(launcher)._get_formatter()._expand_help(action) if action.help else ""
        assert text.count("default") <= 1, f"{action.option_strings}: {text}"


@pytest.mark.parametrize(("flags", "start"), [
    (["--resume", "/no/such.pth"], "error: --resume /no/such.pth: no such file"),
    (["--resume", "/dev/null"], "error: --resume /dev/null: not a regular file"),
    (["--resume", "/tmp"], "error: --resume /tmp: is a folder"),
    (["--output-dir", __file__], f"error: --output-dir {__file__}: is a file"),
    # the next run would find a class folder of weights and logs: "class folder .../run holds no images"
    (["--data-path", "/tmp", "--output-dir", "/tmp/photos/../run"],
     "error: --output-dir /tmp/photos/../run: inside --data-path /tmp, where the next run would read it as a class"),
    (["--data-path", "/tmp/run", "--output-dir", "/tmp/run"], "error: --output-dir /tmp/run: inside --data-path"),
    (["--freeze-layers", "false", "--unfreeze-epoch", "2"], "error: --unfreeze-epoch 2: there is nothing to unfreeze"),
])
def test_files_named_by_flags_are_checked_before_any_work(flags: list[str], start: str,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    def must_not_run(args: object) -> None:
        raise AssertionError("training started")

    with pytest.raises(SystemExit) as stop:
        run_cli(must_not_run, "single", flags)
    assert stop.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(start), line


@pytest.mark.parametrize(("url", "start"), [
    ("file:///no/such/folder/meet",
     "error: --dist-url file:///no/such/folder/meet: there is no folder /no/such/folder"),
    ("file:///tmp", "error: --dist-url file:///tmp: names no file"),
    # PyTorch: a traceback for each of these; and for port 0, a wait for ever (no other rank knows rank 0's port)
    *((url, f"error: --dist-url {url}: expected tcp://HOST:PORT, rank 0's address and a free port")
      for url in ("tcp://127.0.0.1", "tcp://127.0.0.1:0", "tcp://127.0.0.1:99999", "tcp://127.0.0.1:abc",
                  "tcp://:29500", "tcp://")),
])
def test_a_meeting_point_that_cannot_be_met_is_one_line_before_any_process_starts(
        url: str, start: str, capsys: pytest.CaptureFixture[str]) -> None:
    """PyTorch's file store waits for ever on a file it cannot create, whatever --dist-timeout says; a tcp:// URL
    without a host or a usable port ends in a traceback, or waits for ever."""
    with pytest.raises(SystemExit) as stop:
        run_cli(lambda args: pytest.fail("processes started"), "spawn", ["--world-size", "2", "--dist-url", url])
    assert stop.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(start), line


def test_under_a_launcher_rank_0_may_be_another_machine() -> None:
    """Only the spawn script knows that every process runs here; a launcher's rank 0 may run anywhere."""
    started = []
    run_cli(started.append, "launch", ["--dist-url", "tcp://192.0.2.1:29500"])
    assert [args.dist_url for args in started] == ["tcp://192.0.2.1:29500"]


@pytest.mark.parametrize(("flags", "start"), [
    (["--model", "resnet_nine"], "error: --model 'resnet_nine': neither a model registered in model.py nor a "
                                 "torchvision classification model"),
    (["--batch-size", "1"], "error: --batch-size 1: resnet18 cannot train on batches of 1 images"),
    (["--model", "vit_b_16", "--image-size", "64"], "error: --image-size 64: vit_b_16 cannot train"),
    (["--weights", "IMAGENET_NONE"], "error: --weights IMAGENET_NONE: no such file, and not a torchvision weights"),
    (["--data-path", "/no/such/folder"], "error: --data-path /no/such/folder: no such folder"),
    (["--model", ""], "error: --model '': neither a model registered in model.py nor a torchvision"),
    (["--data-path", __file__], f"error: --data-path {__file__}: not a folder"),
])
def test_the_model_and_the_data_are_checked_before_anything_is_written(
        flags: list[str], start: str, image_folder: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = run_single_in_this_process(["--data-path", str(image_folder), "--output-dir", str(out), *TINY_FLAGS,
                                         *flags])
    assert result.returncode == 2
    (line,) = result.stderr.splitlines()
    assert line.startswith(start), line
    assert not out.exists()


def test_one_line_drops_terminal_colour_codes() -> None:
    assert one_line(RuntimeError("\x1b[1mdo this\x1b[0m only if")) == "do this only if"


def test_the_last_collections_are_skipped_once_however_many_runs_a_process_makes() -> None:
    code = ("import gc; freeze = gc.freeze; gc.freeze = lambda: (print('frozen', flush=True), freeze())\n"
            "from multi_train_utils import cli\n"
            "for _ in range(3):\n    with cli.ends_in_one_line(0):\n        pass")
    result = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent.parent, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("frozen") == 1, result.stdout
