"""The command line: the tutorial's flags, booleans that mean what they say, ranges checked."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch.utils.data import DataLoader

from multi_train_utils.cli import DATA_DEFAULTS, DEMO_DEFAULTS, get_args_parser, one_line, parse_args
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


@pytest.mark.parametrize("argv", [["--batch-size", "0"], ["--epochs", "0"], ["--workers", "-1"],
                                  ["--image-size", "8"], ["--world-size", "0"], ["--lr", "-1"],
                                  ["--freeze-layers", "maybe"], ["--batch-size", "two"]])
def test_out_of_range_values_are_refused_naming_the_flag(argv: list[str],
                                                         capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_args("spawn", argv)
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


def test_syncbn_with_compile_is_refused_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """torch.compile breaks its graph at every SyncBatchNorm layer."""
    with pytest.raises(SystemExit) as stop:
        parse_args("launch", ["--syncBN", "--compile"])
    assert stop.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("error: --syncBN with --compile")
    assert parse_args("launch", ["--syncBN", "false", "--compile"]).compile
