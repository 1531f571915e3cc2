"""Building models by name, loading weights that only partly fit, and freezing."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import model
from model import check_model_input, create_model, load_weights
from multi_train_utils import recorder
from multi_train_utils.distributed_utils import DistContext, batchnorm_batch_size
from multi_train_utils.errors import UserInputError
from multi_train_utils.freezing import FrozenBody, classifier_of
from multi_train_utils.train_eval_utils import batch_sums, class_logits, evaluate


@pytest.mark.parametrize(("name", "classifier"), [("resnet18", "fc"), ("mobilenet_v3_small", "classifier.3"),
                                                  ("squeezenet1_1", "classifier.1")])
def test_any_torchvision_model_by_name(name: str, classifier: str) -> None:
    model = create_model(name, num_classes=7)
    assert dict(model.named_modules())[classifier] is classifier_of(model)
    with torch.no_grad():
        assert model.eval()(torch.zeros(1, 3, 64, 64)).shape == (1, 7)


def test_unknown_model_is_a_clear_error() -> None:
    with pytest.raises(UserInputError, match="--model 'resnet35'"):
        create_model("resnet35", 3)


def test_weights_with_another_classifier_load_all_but_the_classifier(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture) -> None:
    imagenet_like = create_model("resnet18", num_classes=1000)
    path = tmp_path / "resnet18-imagenet.pth"
    torch.save(imagenet_like.state_dict(), path)
    model = create_model("resnet18", num_classes=3)
    fresh_fc = model.fc.weight.clone()
    load_weights(model, str(path), "resnet18")
    assert torch.equal(model.conv1.weight, imagenet_like.conv1.weight)
    assert torch.equal(model.layer4[1].bn2.running_var, imagenet_like.layer4[1].bn2.running_var)
    assert torch.equal(model.fc.weight, fresh_fc)
    report = capsys.readouterr().out
    assert "skipped (name or shape differs): fc.bias, fc.weight" in report
    assert f"loaded {len(model.state_dict()) - 2} of {len(model.state_dict())}" in report


def test_weights_saved_from_ddp_or_in_a_checkpoint_load(tmp_path: Path) -> None:
    source = create_model("resnet18", num_classes=3)
    prefixed = {f"module.{k}": v for k, v in source.state_dict().items()}
    torch.save({"model": prefixed, "epoch": 4}, tmp_path / "checkpoint.pth")
    model = create_model("resnet18", num_classes=3)
    load_weights(model, str(tmp_path / "checkpoint.pth"), "resnet18")
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), source.state_dict().values(),
                                                 strict=True))


def test_pickled_code_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "evil.pth"
    torch.save({"model": nn.Linear(2, 2)}, path)  # a whole module: loading it means running pickled code
    with pytest.raises(UserInputError, match="holds Python objects besides tensors") as refused:
        load_weights(create_model("resnet18", 3), str(path), "resnet18")
    # Not PyTorch's advice to load it anyway (weights_only=False), nor its terminal colour codes.
    assert "weights_only" not in str(refused.value) and "\x1b" not in str(refused.value)


class RunsACommand:
    """What a booby-trapped .pth file holds: unpickling it would run a shell command."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        import os

        return os.system, (f"touch {self.marker}",)


def test_a_file_that_would_run_code_is_named_for_what_it_is_wherever_it_is_loaded(tmp_path: Path) -> None:
    """--weights, --eval-only's weights and predict.py's (load_weights) and --resume (read_checkpoint): never
    run, and never called damaged, whatever case the installed torch writes its "unsupported global" in."""
    marker, path = tmp_path / "ran", tmp_path / "trap.pth"
    torch.save({"model": RunsACommand(marker), "optimizer": {}, "scheduler": {}, "epoch": 0}, path)
    loads = [lambda: load_weights(create_model("resnet18", 3), str(path), "resnet18"),
             lambda: recorder.read_checkpoint(path)]
    for load in loads:
        with pytest.raises(UserInputError, match="holds Python objects besides tensors, which are not loaded"):
            load()
    assert not marker.exists(), "the command ran"


@pytest.mark.parametrize(("content", "message"), [(b"plain text", "not a PyTorch file"),
                                                  (None, "none of its 1 tensors fit")])
def test_bad_weights_file_is_a_clear_error(tmp_path: Path, content: bytes | None, message: str) -> None:
    path = tmp_path / "weights.pth"
    if content is None:
        torch.save({"something.else": torch.zeros(2)}, path)
    else:
        path.write_bytes(content)
    with pytest.raises(UserInputError, match=message):
        load_weights(create_model("resnet18", 3), str(path), "resnet18")


def test_unknown_weights_name_lists_the_choices_once_each() -> None:
    with pytest.raises(UserInputError) as caught:
        load_weights(create_model("resnet34", 3), "no_such_file.pth", "resnet34")
    assert str(caught.value).endswith("(one of DEFAULT, IMAGENET1K_V1)")


def test_freeze_layers_trains_only_the_classifier_until_the_epoch_to_unfreeze() -> None:
    """Set from the epoch alone, at the start of each: a run resumed at epoch 3 freezes what epoch 3 froze."""
    model = create_model("resnet18", num_classes=4)
    frozen, every = FrozenBody(model, unfreeze_epoch=2), {name for name, _ in model.named_parameters()}
    for epoch, trainable in ((0, {"fc.weight", "fc.bias"}), (3, every), (1, {"fc.weight", "fc.bias"})):
        frozen.on_epoch_start(epoch)
        assert {name for name, p in model.named_parameters() if p.requires_grad} == trainable, epoch
    always = FrozenBody(model)
    always.on_epoch_start(100)
    assert {name for name, p in model.named_parameters() if p.requires_grad} == {"fc.weight", "fc.bias"}


def test_a_weights_name_without_network_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import urllib.error

    import torchvision.models._api

    def no_network(url: str, *args: object, **kwargs: object) -> None:
        raise urllib.error.URLError("Temporary failure in name resolution")

    monkeypatch.setattr(torchvision.models._api, "load_state_dict_from_url", no_network)
    with pytest.raises(UserInputError, match=r"--weights DEFAULT: could not download https://.*resnet18"):
        load_weights(create_model("resnet18", 3), "DEFAULT", "resnet18")


def test_a_weights_name_loads_torchvisions_published_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    published = create_model("resnet18", num_classes=1000).state_dict()
    import torchvision.models._api

    monkeypatch.setattr(torchvision.models._api, "load_state_dict_from_url", lambda url, **kw: published)
    model = create_model("resnet18", 3)
    load_weights(model, "IMAGENET1K_V1", "resnet18")
    assert torch.equal(model.conv1.weight, published["conv1.weight"])


@pytest.mark.parametrize(("make", "message"), [
    (lambda path: path.write_bytes(b""), "is empty \\(0 bytes\\)"),
    (lambda path: path.mkdir(), "is a folder"),
    (lambda path: path.write_bytes(b"PK\x03\x04 cut short"), "not a PyTorch file"),
])
@pytest.mark.parametrize("flag", ["--weights", "--resume"])
def test_files_of_the_wrong_kind_are_named_in_our_own_words(tmp_path: Path, make: Callable[[Path], object],
                                                            message: str, flag: str) -> None:
    path = tmp_path / "file.pth"
    make(path)
    with pytest.raises(UserInputError, match=f"^{flag} {path}: {message}"):
        if flag == "--weights":
            load_weights(create_model("resnet18", 3), str(path), "resnet18")
        else:
            recorder.read_checkpoint(recorder.checkpoint_to_resume(str(path), tmp_path))


@pytest.mark.parametrize(("model", "image_size", "batch_size", "flag"), [
    ("resnet18", 32, 1, "--batch-size 1"), ("vit_b_16", 64, 4, "--image-size 64"),
    ("alexnet", 16, 4, "--image-size 16")])
def test_a_batch_the_model_cannot_train_on_is_refused_before_any_work(model: str, image_size: int,
                                                                      batch_size: int, flag: str) -> None:
    with pytest.raises(UserInputError, match=f"^{flag}: {model} cannot train on batches of {batch_size} images"):
        check_model_input(model, image_size, batch_size)
    check_model_input(model, 224, 2)


@pytest.mark.parametrize("name", ["googlenet", "inception_v3"])
def test_the_models_with_auxiliary_classifiers_train_on_their_logits(name: str) -> None:
    """torchvision builds these with auxiliary classifiers, whose outputs come beside the logits while training:
    the loss would fail on them with a traceback at the first step."""
    check_model_input(name, 80, 2)
    model = create_model(name, num_classes=3).train()
    nn.CrossEntropyLoss()(model(torch.rand(2, 3, 80, 80)), torch.tensor([0, 2])).backward()


class TwoHeads(nn.Module):
    """A classifier and a second head (whether the class index is odd), returned as the tuple (logits, parity)."""

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.body = nn.Conv2d(3, 4, 3)
        self.head, self.parity = nn.Linear(4, num_classes), nn.Linear(4, 2)

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = self.body(images).mean(dim=(2, 3))
        return self.head(features), self.parity(features)


def test_a_model_with_a_second_head_trains_and_validates_on_its_class_logits(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default loss, the accuracy and the confusion matrix take the class logits, the tuple's first item;
    a loss of one's own gets the whole tuple."""
    monkeypatch.setitem(model.MODELS, "two_heads", TwoHeads)
    check_model_input("two_heads", 32, 2)
    net = create_model("two_heads", num_classes=3)
    images, labels = torch.rand(6, 3, 16, 16), torch.tensor([0, 1, 2, 0, 1, 2])
    logits, parity = net(images)
    criterion = model.build_criterion(label_smoothing=0.1)
    assert torch.equal(criterion((logits, parity), labels), nn.CrossEntropyLoss(label_smoothing=0.1)(logits, labels))
    sums = batch_sums((logits, parity), labels, criterion, 3)
    assert int(sums["correct"]) == int((logits.argmax(1) == labels).sum())
    assert int(sums["confusion"].sum()) == 6
    seen = []

    def both_heads(output: tuple[torch.Tensor, torch.Tensor], targets: torch.Tensor) -> torch.Tensor:
        seen.append(type(output))
        return nn.functional.cross_entropy(output[0], targets) + nn.functional.cross_entropy(output[1], targets % 2)

    loader = DataLoader(TensorDataset(images, labels), batch_size=3)
    result = evaluate(net, both_heads, loader, torch.device("cpu"), num_classes=3)
    assert seen == [tuple, tuple] and result.total == 6


def test_a_dict_a_list_or_a_namedtuple_gives_its_logits_and_the_loss_sees_it_in_float32() -> None:
    from torchvision.models.inception import InceptionOutputs

    logits = torch.rand(2, 3)
    assert class_logits({"logits": logits, "aux": torch.rand(2, 1)}) is logits
    assert class_logits([logits, None]) is logits and class_logits(logits) is logits
    half = InceptionOutputs(logits.bfloat16(), torch.rand(2, 3).bfloat16())
    seen = []
    batch_sums(half, torch.tensor([0, 2]), lambda output, labels: seen.append(output) or output.logits.sum(), 3)
    assert type(seen[0]) is InceptionOutputs and {tensor.dtype for tensor in seen[0]} == {torch.float32}


@pytest.mark.parametrize("output", ["dict", "features first"])
def test_a_model_whose_class_logits_cannot_be_found_is_one_line(monkeypatch: pytest.MonkeyPatch, output: str) -> None:
    class Hidden(TwoHeads):
        def forward(self, images: torch.Tensor) -> object:
            logits, _ = super().forward(images)
            return {"scores": logits} if output == "dict" else (images.flatten(1), logits)

    monkeypatch.setitem(model.MODELS, "hidden", Hidden)
    kind = "dict" if output == "dict" else "tuple"
    with pytest.raises(UserInputError, match=rf"^--model hidden: its forward returns a {kind} while training, in which "
                                             r"train_eval_utils.class_logits finds no class logits"):
        check_model_input("hidden", 32, 2)


def test_timm_models_by_name_where_timm_is_installed() -> None:
    pytest.importorskip("timm")
    assert model.model_source("timm/resnet18") == "timm" and model.model_source("resnet18") == "torchvision"
    net = create_model("timm/resnet18", num_classes=3)
    check_model_input("timm/resnet18", 32, 2)
    with torch.no_grad():
        assert net.eval()(torch.zeros(1, 3, 32, 32)).shape == (1, 3)
    with pytest.raises(UserInputError, match=r"^--model timm/resnet19: timm has no model 'resnet19'"):
        create_model("timm/resnet19", 3)
    with pytest.raises(UserInputError, match=r"^--weights IMAGENET1K_V1: no such file, and not a timm pretrained "
                                             r"tag for resnet18 \(DEFAULT, or one of a1_in1k, "):
        load_weights(net, "IMAGENET1K_V1", "timm/resnet18")


def test_timm_weights_that_cannot_be_downloaded_are_one_line(monkeypatch: pytest.MonkeyPatch,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    timm = pytest.importorskip("timm")
    net = create_model("timm/resnet18", num_classes=3)

    def offline(name: str, pretrained: bool = False, **kwargs: object) -> nn.Module:
        logging.getLogger("huggingface_hub").warning("thrown while requesting HEAD https://huggingface.co/...")
        raise OSError("We cannot find the requested files in the local cache.\nCheck your connection.")

    monkeypatch.setattr(timm, "create_model", offline)
    with pytest.raises(UserInputError, match=r"^--weights a1_in1k: timm could not load resnet18's pretrained weights "
                                             r"\(We cannot find the requested files in the local cache.\); download "
                                             "them elsewhere and pass the file's path instead$"):
        load_weights(net, "a1_in1k", "timm/resnet18")
    assert "thrown while requesting" not in caplog.text, "the hub's own warning would come before the line"


def test_without_timm_a_timm_model_is_one_line_saying_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "timm", None)  # as if not installed: importing it raises ModuleNotFoundError
    with pytest.raises(UserInputError, match=r"^--model timm/resnet18: a timm model, and timm is not installed here: "
                                             r"pip install timm$"):
        check_model_input("timm/resnet18", 32, 2)
    with pytest.raises(UserInputError, match=r"nor one of timm.s as timm/NAME$"):
        model.model_source("resnet35")


def test_weights_by_name_for_a_model_of_ones_own_say_none_are_published(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(model.MODELS, "two_heads", TwoHeads)
    with pytest.raises(UserInputError, match=r"^--weights DEFAULT: no such file \(two_heads is a model of model.py, "
                                             r"for which no weights are published\)"):
        load_weights(create_model("two_heads", 3), "DEFAULT", "two_heads")


def test_batch_norm_of_one_image_is_refused_unless_sync_batch_norm_sees_several_processes() -> None:
    """On 2 GPUs, SyncBatchNorm normalises over the global batch, so --batch-size 1 trains; with plain BatchNorm
    (any CPU run, or one process) it cannot. The rule is a function of the context, tested without a GPU."""
    gpus, cpus = (DistContext(0, 0, 2, 2, torch.device(kind, 0) if kind == "cuda" else torch.device("cpu"), True)
                  for kind in ("cuda", "cpu"))
    assert batchnorm_batch_size(1, gpus, sync_bn=True) == 2
    check_model_input("resnet18", 32, batchnorm_batch_size(1, gpus, sync_bn=True))
    for ctx, sync_bn in ((gpus, False), (cpus, True)):
        with pytest.raises(UserInputError, match=r"^--batch-size 1: resnet18 cannot train on batches of 1 images"):
            check_model_input("resnet18", 32, batchnorm_batch_size(1, ctx, sync_bn))
