"""The opt-in speed settings of the loop: mixed precision, channels-last, torch.compile, and the flags."""

from __future__ import annotations

import json
from pathlib import Path

import ddp_workers
import pytest
import torch
from torch import nn

import multi_train_utils.versions as versions
import train_single_gpu
from conftest import TINY_FLAGS, checkpointer, make_image_folder
from multi_train_utils import checkpoint, files, recorder
from multi_train_utils.cli import parse_args
from multi_train_utils.distributed_utils import single_process, unwrap_model, wrap_ddp
from multi_train_utils.errors import UserInputError
from multi_train_utils.optim import Hook, Hooks, StepEnd, StepOptions, autocast_dtype
from multi_train_utils.train_eval_utils import evaluate, train_one_epoch


def record_conv_io(model: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(input, output) of the first convolution of every forward pass."""
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    conv = next(m for m in model.modules() if isinstance(m, nn.Conv2d))
    conv.register_forward_hook(lambda _module, inputs, output: seen.append((inputs[0], output)))
    return seen


def one_epoch(options: StepOptions, model: nn.Module | None = None) -> tuple[nn.Module, float]:
    model = model or ddp_workers.small_net()
    model = model.to(memory_format=options.memory_format)
    optimizer = ddp_workers.build_optimizer(model, lr=0.05)
    loader = torch.utils.data.DataLoader(ddp_workers.fixed_data(16), batch_size=4)
    return model, train_one_epoch(model, nn.CrossEntropyLoss(), optimizer, loader, torch.device("cpu"), 0,
                                  options=options)


def test_bf16_autocast_on_cpu_runs_the_convolutions_in_bf16_and_trains() -> None:
    model = ddp_workers.small_net()
    seen = record_conv_io(model)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    model, loss = one_epoch(StepOptions("cpu", amp_dtype=torch.bfloat16), model)
    assert {output.dtype for _, output in seen} == {torch.bfloat16}
    assert all(p.dtype == torch.float32 for p in model.parameters()), "the weights stay float32"
    assert torch.isfinite(torch.tensor(loss))
    assert any(not torch.equal(start[k], v) for k, v in model.state_dict().items())


def test_channels_last_reaches_the_weights_and_the_images() -> None:
    model = ddp_workers.small_net()
    seen = record_conv_io(model)
    model, _ = one_epoch(StepOptions("cpu", channels_last=True), model)
    assert model[0].weight.is_contiguous(memory_format=torch.channels_last)
    assert all(images.is_contiguous(memory_format=torch.channels_last) for images, _ in seen)
    loader = torch.utils.data.DataLoader(ddp_workers.fixed_data(8), batch_size=4)
    result = evaluate(model, nn.CrossEntropyLoss(), loader, torch.device("cpu"), StepOptions("cpu", channels_last=True))
    assert result.figures()["val_total"] == 8


@pytest.mark.parametrize(("amp", "has_bf16", "expected"), [
    ("off", True, None), ("auto", True, torch.bfloat16), ("bf16", True, torch.bfloat16),
    ("auto", False, None), ("bf16", False, torch.bfloat16),
])
def test_amp_choices_on_cpu(amp: str, has_bf16: bool, expected: torch.dtype | None,
                            monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """auto never picks an emulated bf16 (25 times slower here); an explicit bf16 is kept, with a warning."""
    monkeypatch.setattr(versions, "cpu_has_bf16", lambda: has_bf16)
    assert autocast_dtype(amp, torch.device("cpu")) == expected
    warned = "this CPU has no bfloat16 instructions" in capsys.readouterr().out
    assert warned == (amp != "off" and not has_bf16)


def test_fp16_on_cpu_is_refused_naming_the_flag() -> None:
    with pytest.raises(UserInputError, match=r"^--amp fp16: .*--amp bf16"):
        autocast_dtype("fp16", torch.device("cpu"))


def test_options_from_the_command_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(versions, "cpu_has_bf16", lambda: True)
    args = parse_args("launch", ["--amp", "--channels-last", "--accum-steps", "3", "--comm-hook", "bf16",
                                 "--bucket-cap-mb", "50"])
    options = StepOptions.from_args(args, torch.device("cpu"))
    assert (options.amp_dtype, options.channels_last, options.accum_steps) == (torch.bfloat16, True, 3)
    assert not options.scaler.is_enabled(), "bf16 needs no loss scaling"
    assert (args.comm_hook, args.bucket_cap_mb) == ("bf16", 50.0)
    plain = StepOptions.from_args(parse_args("single", []), torch.device("cpu"))
    assert (plain.amp_dtype, plain.channels_last, plain.accum_steps) == (None, False, 1)


def test_the_loss_scale_is_saved_and_restored(tmp_path: Path) -> None:
    """fp16 runs keep GradScaler's scale in the checkpoint; a resumed run must not start from 65536 again."""
    model = ddp_workers.small_net()
    optimizer = ddp_workers.build_optimizer(model, lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale(torch.ones(()))  # the scale exists from the first scaled loss on
    scaler.update(new_scale=256.0)
    with checkpointer(model, optimizer, tmp_path / "run", StepOptions(scaler=scaler)) as saver:
        saver.save_epoch(0)
    options = StepOptions(scaler=torch.amp.GradScaler("cpu"))
    saved = recorder.find_saved_run("auto", tmp_path / "run")
    with checkpointer(model, optimizer, tmp_path / "resumed", options) as resumed:
        assert resumed.resume(saved) == 1
    assert options.scaler.get_scale() == 256.0


def test_a_run_without_fp16_resumes_with_fp16(tmp_path: Path) -> None:
    """A disabled scaler saves nothing; loading that into an enabled one must not fail."""
    model = ddp_workers.small_net()
    optimizer = ddp_workers.build_optimizer(model, lr=0.05)
    with checkpointer(model, optimizer, tmp_path / "run") as saver:
        saver.save_epoch(0)
    saved = recorder.find_saved_run("auto", tmp_path / "run")
    assert saved.state["scaler"] == {}
    options = StepOptions(scaler=torch.amp.GradScaler("cpu", init_scale=512.0))
    with checkpointer(model, optimizer, tmp_path / "resumed", options) as resumed:
        resumed.resume(saved)
    assert options.scaler.get_scale() == 512.0


@pytest.mark.parametrize(("amp", "bf16_on_gpu", "expected"), [
    ("auto", True, torch.bfloat16), ("auto", False, torch.float16), ("fp16", True, torch.float16)])
def test_amp_choices_on_a_gpu(amp: str, bf16_on_gpu: bool, expected: torch.dtype,
                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Emulated bf16 does not count: older GPUs get fp16 with loss scaling. (torch says every GPU has bf16
    when emulation counts, as it does by default.)"""
    monkeypatch.setattr(torch.cuda, "is_bf16_supported",
                        lambda including_emulation=True: True if including_emulation else bf16_on_gpu)
    assert autocast_dtype(amp, torch.device("cuda")) == expected
    if not bf16_on_gpu:
        with pytest.raises(UserInputError, match=r"^--amp bf16: this GPU has no bfloat16"):
            autocast_dtype("bf16", torch.device("cuda"))


def test_a_compiled_model_saves_without_the_compile_prefix() -> None:
    """torch.compile compiles at the first forward pass (a minute on a small CPU: that part is a GPU test)."""
    model = wrap_ddp(ddp_workers.small_net(), single_process("cpu"), compile_model=True)
    assert "_orig_mod.0.weight" in model.state_dict()
    assert set(unwrap_model(model).state_dict()) == set(ddp_workers.small_net().state_dict())


def test_the_speed_flags_train_a_whole_run(tmp_path: Path) -> None:
    data = make_image_folder(tmp_path / "images", {"red": 12, "green": 12, "blue": 12})
    out = tmp_path / "run"
    args = parse_args("single", ["--data-path", str(data), "--output-dir", str(out), *TINY_FLAGS,
                                 "--amp", "bf16", "--channels-last", "--accum-steps", "2", "--lr", "0.001",
                                 "--image-size", "32"])
    # At 16 px resnet18's last two stages see 1 x 1 maps, where PyTorch's bf16 backward on the CPU turns a
    # gradient NaN on some draws of the weights (1 run in 15 here; at 32 px none in 60).
    train_single_gpu.main(args)
    metrics = json.loads((out / "metrics.jsonl").read_text())
    assert metrics["lr"] == pytest.approx(0.002), "the lr grows with the accumulated batch"
    assert torch.load(out / "checkpoint.pth", weights_only=True)["args"]["amp"] == "bf16"


def test_bad_speed_flags_are_one_line_errors() -> None:
    for argv in (["--amp", "fp8"], ["--accum-steps", "0"], ["--comm-hook", "int8"]):
        with pytest.raises(UserInputError, match=f"^argument {argv[0]}: "):
            parse_args("launch", argv)


def trained_optimizer_state(fused: bool) -> dict:
    """The optimizer state of a run with default-layout weights and the given fused setting (a CPU run)."""
    model = nn.Conv2d(3, 4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=fused)
    model(torch.randn(2, 3, 8, 8)).sum().backward()
    optimizer.step()
    return optimizer.state_dict()


def test_a_checkpoint_resumes_under_other_optimizer_options_and_memory_format() -> None:
    """Saved by a CPU run (not fused, NCHW), resumed by a fused, channels-last, loss-scaled run: the fused
    step refuses the saved options ("Expected grad_scale and found_inf to be None") unless they are fitted."""
    model = nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.5, fused=True)
    saved = trained_optimizer_state(fused=False)
    checkpoint.load_optimizer_state(optimizer, saved)
    group = optimizer.param_groups[0]
    assert group["fused"] is True, "how to run is this run's choice"
    assert (group["lr"], group["momentum"]) == (0.5, 0.5), "the options are this run's flags, changed or not"
    momentum = optimizer.state[model.weight]["momentum_buffer"]
    assert momentum.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(momentum, saved["state"][0]["momentum_buffer"])
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    model(torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last)).sum().backward()
    scaler.scale(torch.zeros((), requires_grad=True)).backward()
    scaler.step(optimizer)  # raised before the options were fitted


def test_checkpoint_tensors_are_saved_on_the_cpu() -> None:
    moved = files.to_cpu({"a": [torch.ones(2), (torch.zeros(1), 3)], "b": "text"})
    assert moved["a"][0].device.type == "cpu" and isinstance(moved["a"][1], tuple) and moved["b"] == "text"


@pytest.mark.filterwarnings("ignore:torch.cuda.amp.GradScaler is enabled")
@pytest.mark.parametrize("amp", ["fp16", "auto"])
def test_fp16_gradients_are_not_sent_as_fp16(monkeypatch: pytest.MonkeyPatch, amp: str) -> None:
    """PyTorch's fp16 hook casts loss-scaled gradients to fp16 before dividing by the world size."""
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    args = parse_args("launch", ["--amp", amp, "--comm-hook", "fp16"])
    with pytest.raises(UserInputError, match="--comm-hook fp16 with fp16 autocast"):
        StepOptions.from_args(args, torch.device("cuda"))
    assert StepOptions.from_args(parse_args("launch", ["--amp", amp, "--comm-hook", "bf16"]),
                                 torch.device("cuda")).amp_dtype == torch.float16


def test_the_loop_stops_after_max_steps_optimizer_steps_with_everything_a_step_does() -> None:
    """max_steps=3 with --accum-steps 2 and clipping: the same weights as a whole epoch of the first 12 images
    (three steps of two accumulated batches each), three steps told to the hooks, the loss of those images."""
    options = StepOptions("cpu", accum_steps=2, clip_grad_norm=0.5)
    steps: list[int] = []

    class Steps(Hook):
        def on_step_end(self, step: StepEnd) -> None:
            steps.append(step.step)

    first = ddp_workers.small_net()
    loader = torch.utils.data.DataLoader(ddp_workers.fixed_data(40), batch_size=2)
    loss = train_one_epoch(first, nn.CrossEntropyLoss(), ddp_workers.build_optimizer(first, lr=0.05), loader,
                           torch.device("cpu"), 0, options=options, hooks=Hooks([Steps()]), max_steps=3)
    whole = ddp_workers.small_net()
    twelve = torch.utils.data.DataLoader(torch.utils.data.Subset(ddp_workers.fixed_data(40), range(12)), batch_size=2)
    whole_loss = train_one_epoch(whole, nn.CrossEntropyLoss(), ddp_workers.build_optimizer(whole, lr=0.05), twelve,
                                 torch.device("cpu"), 0, options=options)
    assert steps == [1, 2, 3]
    assert loss == pytest.approx(whole_loss)
    assert all(torch.equal(a, b) for a, b in zip(first.state_dict().values(), whole.state_dict().values(), strict=True))
