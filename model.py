"""The models --model names, decided here alone (`model_source`): your own (register them here), every torchvision
classification model, and, where timm is installed (optional: `pip install timm`), timm's as `timm/NAME`; with
optional starting weights; and the loss they train with (`build_criterion`), the one the three scripts use."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torchvision
from torch import nn

from multi_train_utils.distributed_utils import print_main
from multi_train_utils.errors import UserInputError
from multi_train_utils.files import load_file
from multi_train_utils.train_eval_utils import class_logits

ModelFactory = Callable[..., nn.Module]  # called as factory(num_classes=N)
MODELS: dict[str, ModelFactory] = {}  # your own models, by the name --model gives them
TIMM = "timm/"  # --model timm/resnet50: timm's resnet50, where timm is installed
# torchvision's two models with auxiliary classifiers return those outputs beside the logits while training, which
# the loss does not take: built without them (their weights initialised as torchvision does, without its warning).
WITHOUT_AUX_LOGITS = {"googlenet": {"aux_logits": False, "init_weights": True},
                      "inception_v3": {"aux_logits": False, "init_weights": True}}


def register_model(name: str) -> Callable[[ModelFactory], ModelFactory]:
    """Make a model class (or a function that builds one) a choice of --model: it is called with
    num_classes=N, and wins over a torchvision model of the same name."""

    def register(factory: ModelFactory) -> ModelFactory:
        MODELS[name] = factory
        return factory

    return register


def model_source(name: str) -> str:
    """Where --model `name` comes from: "own" (registered here), "timm" (timm/NAME) or "torchvision"; any other
    name is refused in one line. Building, weights and the checks all ask here."""
    if name in MODELS:
        return "own"
    if name.startswith(TIMM) and timm_module(name).is_model(name.removeprefix(TIMM)):
        return "timm"
    if name in torchvision.models.list_models(module=torchvision.models):
        return "torchvision"
    raise unknown_model(name)


def unknown_model(name: str) -> UserInputError:
    if name.startswith(TIMM):
        return UserInputError(f"--model {name}: timm has no model {name.removeprefix(TIMM)!r} (timm.list_models() "
                              "lists them, such as timm/resnet50 or timm/convnext_tiny)")
    own = f"; or one of your own: {', '.join(MODELS)}" if MODELS else ""
    return UserInputError(f"--model {name!r}: neither a model registered in model.py nor a torchvision "
                          f"classification model (for example resnet18, resnet34, mobilenet_v3_small) nor one of "
                          f"timm's as timm/NAME{own}")


def timm_module(name: str) -> ModuleType:
    """timm, optional: imported only for a --model timm/NAME."""
    try:
        import timm
    except ModuleNotFoundError:
        raise UserInputError(f"--model {name}: a timm model, and timm is not installed here: pip install timm"
                             ) from None
    return timm


def create_model(name: str = "resnet34", num_classes: int = 1000) -> nn.Module:
    """A freshly initialised model with `num_classes` outputs."""
    source = model_source(name)
    if source == "own":
        return MODELS[name](num_classes=num_classes)
    if source == "timm":
        return timm_module(name).create_model(name.removeprefix(TIMM), num_classes=num_classes)
    return torchvision.models.get_model(name, weights=None, num_classes=num_classes, **WITHOUT_AUX_LOGITS.get(name, {}))


class ClassificationLoss(nn.CrossEntropyLoss):
    """nn.CrossEntropyLoss of the class logits in whatever the model returns (train_eval_utils.class_logits): a
    model that returns more than its logits (a second head, auxiliary outputs) trains its classifier unchanged."""

    def forward(self, output: Any, labels: torch.Tensor) -> torch.Tensor:
        return super().forward(class_logits(output), labels)


def build_criterion(label_smoothing: float = 0.0) -> nn.Module:
    """The loss every script trains and validates with: criterion(model(images), labels), the batch's mean (with
    MixUp or CutMix the labels are each class's share). A loss of your own replaces it here, for all three."""
    return ClassificationLoss(label_smoothing=label_smoothing)


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """Tensors from a plain state dict or from one of our checkpoints; `module.` prefixes removed."""
    content = load_file(path, "--weights")
    if isinstance(content, dict) and isinstance(content.get("model"), dict):
        content = content["model"]
    if not isinstance(content, dict) or not all(isinstance(v, torch.Tensor) for v in content.values()):
        raise UserInputError(f"--weights {path}: holds no state dict of tensors")
    return {k.removeprefix("module."): v for k, v in content.items()}


def weights_enum(model_name: str, weights_name: str) -> torchvision.models.WeightsEnum:
    """torchvision's published weights of that name, such as DEFAULT or IMAGENET1K_V1."""
    published = torchvision.models.get_model_weights(model_name)
    try:
        return published[weights_name]
    except KeyError:
        # DEFAULT is an alias of one of the names, which __members__ lists once more under its own name.
        names = ", ".join(dict.fromkeys(["DEFAULT", *(weights.name for weights in published)]))
        raise UserInputError(f"--weights {weights_name}: no such file, and not a torchvision weights name for "
                             f"{model_name} (one of {names})") from None


def timm_state_dict(model_name: str, weights_name: str) -> dict[str, torch.Tensor]:
    """timm's pretrained weights: DEFAULT, or a tag of timm.list_pretrained() such as a1_in1k (needs the network)."""
    timm, arch = timm_module(model_name), model_name.removeprefix(TIMM)
    tags = [name.split(".", 1)[1] for name in timm.list_pretrained(f"{arch}.*")]
    if weights_name != "DEFAULT" and weights_name not in tags:
        raise UserInputError(f"--weights {weights_name}: no such file, and not a timm pretrained tag for {arch} "
                             f"(DEFAULT{', or one of ' + ', '.join(tags[:8]) if tags else '; timm has none'})")
    hub_log = logging.getLogger("huggingface_hub")
    level = hub_log.level
    hub_log.setLevel(logging.ERROR)  # its warning of each failed request would come before the one line below
    try:
        named = arch if weights_name == "DEFAULT" else f"{arch}.{weights_name}"
        return timm.create_model(named, pretrained=True).state_dict()
    except Exception as err:
        raise UserInputError(f"--weights {weights_name}: timm could not load {arch}'s pretrained weights "
                             f"({str(err).splitlines()[0] if str(err) else type(err).__name__}); download them "
                             "elsewhere and pass the file's path instead") from None
    finally:
        hub_log.setLevel(level)


def download_state_dict(model_name: str, weights_name: str) -> dict[str, torch.Tensor]:
    """The published weights of that name, torchvision's or timm's (needs the network once)."""
    source = model_source(model_name)
    if source == "own":
        raise UserInputError(f"--weights {weights_name}: no such file ({model_name} is a model of model.py, for "
                             "which no weights are published)")
    if source == "timm":
        return timm_state_dict(model_name, weights_name)
    weights = weights_enum(model_name, weights_name)
    try:
        return weights.get_state_dict(progress=False)
    except Exception as err:
        raise UserInputError(f"--weights {weights_name}: could not download {weights.url} ({err}); download "
                             "it elsewhere and pass the file's path instead") from None


def check_model_input(name: str, image_size: int, batch_size: int) -> None:
    """One training forward pass on the meta device (shapes only) with the batch BatchNorm normalises, so that an
    image size the model cannot take, a batch BatchNorm cannot normalise, or an output whose class logits
    (train_eval_utils.class_logits) cannot be found fails now in one line."""
    try:
        with torch.device("meta"):
            model = create_model(name, num_classes=2)
        output = model.train()(torch.empty(batch_size, 3, image_size, image_size, device="meta"))
    except UserInputError:
        raise  # the name itself (model_source): a ValueError, but not the shapes' one
    except NotImplementedError:
        return  # this model cannot be built without memory: its first real step will tell
    except (RuntimeError, ValueError, AssertionError) as err:
        raise untrainable_size(err, name, image_size, batch_size) from None
    try:
        logits = class_logits(output)
    except (LookupError, TypeError):
        logits = None
    if not isinstance(logits, torch.Tensor) or logits.shape != (batch_size, 2):
        raise UserInputError(f"--model {name}: its forward returns a {type(output).__name__} while training, in which "
                             "train_eval_utils.class_logits finds no class logits (a tensor of batch x classes); "
                             "return them first, or change class_logits to find them")


def untrainable_size(err: Exception, name: str, image_size: int, batch_size: int) -> UserInputError:
    """The flag whose size the model's forward pass failed on (`err`), in one line."""
    flag = "--batch-size" if "more than 1 value per channel" in str(err) else "--image-size"
    return UserInputError(f"{flag} {batch_size if flag == '--batch-size' else image_size}: {name} cannot train on "
                          f"batches of {batch_size} images of {image_size} x {image_size} px "
                          f"({str(err).splitlines()[0]})")


def load_weights(model: nn.Module, source: str, model_name: str, strict: bool = False) -> None:
    """Copy every tensor of `source` whose name and shape fit `model`; report what was left out.

    A classifier trained for another number of classes does not fit and keeps its fresh initialisation;
    with `strict` (weights to evaluate, not to start from), every tensor must fit.
    """
    path = Path(source)
    state = read_state_dict(path) if path.exists() else download_state_dict(model_name, source)
    own = model.state_dict()
    fitting = {k: v for k, v in state.items() if k in own and own[k].shape == v.shape}
    if not fitting:
        raise UserInputError(f"--weights {source}: none of its {len(state)} tensors fit {model_name}")
    skipped = sorted(set(state) - set(fitting))
    missing = sorted(set(own) - set(fitting))
    if strict and (skipped or missing):
        raise UserInputError(f"--weights {source}: saved from another model or for other classes; "
                             f"{len(skipped) + len(missing)} tensor(s) do not fit {model_name} "
                             f"(such as {(skipped or missing)[0]})")
    model.load_state_dict(fitting, strict=False)
    print_main(f"--weights {os.fspath(source)}: loaded {len(fitting)} of {len(own)} tensors"
               + (f"; skipped (name or shape differs): {', '.join(skipped)}" if skipped else "")
               + (f"; left at their initial values: {', '.join(missing)}" if missing else ""))


def build_model(name: str, num_classes: int, weights: str = "", strict: bool = False,
                trains_on: tuple[int, int] | None = None) -> nn.Module:
    """The model with its starting weights (all of them, if `strict`), checked first on `trains_on`: (batch, size)."""
    if trains_on is not None:
        check_model_input(name, trains_on[1], trains_on[0])
    model = create_model(name, num_classes)
    if weights:
        load_weights(model, weights, name, strict)
    return model
