"""The models --model names: your own (register them here) and every torchvision classification model; with
optional starting weights."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch
import torchvision
from torch import nn

from multi_train_utils.distributed_utils import print_main
from multi_train_utils.errors import UserInputError
from multi_train_utils.files import load_file

ModelFactory = Callable[..., nn.Module]  # called as factory(num_classes=N)
MODELS: dict[str, ModelFactory] = {}  # your own models, by the name --model gives them
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


def model_names() -> list[str]:
    """The names --model takes: the models registered here, then torchvision's classification models."""
    return [*MODELS, *torchvision.models.list_models(module=torchvision.models)]


def check_model_name(name: str) -> None:
    if name not in model_names():
        own = f"; or one of your own: {', '.join(MODELS)}" if MODELS else ""
        raise UserInputError(f"--model {name!r}: neither a model registered in model.py nor a torchvision "
                             f"classification model (for example resnet18, resnet34, mobilenet_v3_small{own})")


def create_model(name: str = "resnet34", num_classes: int = 1000) -> nn.Module:
    """A freshly initialised model with `num_classes` outputs."""
    check_model_name(name)
    if name in MODELS:
        return MODELS[name](num_classes=num_classes)
    return torchvision.models.get_model(name, weights=None, num_classes=num_classes, **WITHOUT_AUX_LOGITS.get(name, {}))


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
    if model_name in MODELS:
        raise UserInputError(f"--weights {weights_name}: no such file ({model_name} is a model of model.py, for "
                             "which torchvision publishes no weights)")
    published = torchvision.models.get_model_weights(model_name)
    try:
        return published[weights_name]
    except KeyError:
        # DEFAULT is an alias of one of the names, which __members__ lists once more under its own name.
        names = ", ".join(dict.fromkeys(["DEFAULT", *(weights.name for weights in published)]))
        raise UserInputError(f"--weights {weights_name}: no such file, and not a torchvision weights name for "
                             f"{model_name} (one of {names})") from None


def download_state_dict(model_name: str, weights_name: str) -> dict[str, torch.Tensor]:
    """torchvision's published weights (needs the network once)."""
    weights = weights_enum(model_name, weights_name)
    try:
        return weights.get_state_dict(progress=False)
    except Exception as err:
        raise UserInputError(f"--weights {weights_name}: could not download {weights.url} ({err}); download "
                             "it elsewhere and pass the file's path instead") from None


def check_model_input(name: str, image_size: int, batch_size: int) -> None:
    """One training forward pass on the meta device (shapes only) with the batch BatchNorm normalises, so that an
    image size the model cannot take, a batch BatchNorm cannot normalise, or an output that is not the logits fails
    now in one line."""
    check_model_name(name)
    try:
        with torch.device("meta"):
            model = create_model(name, num_classes=2)
        output = model.train()(torch.empty(batch_size, 3, image_size, image_size, device="meta"))
    except NotImplementedError:
        return  # this model cannot be built without memory: its first real step will tell
    except (RuntimeError, ValueError, AssertionError) as err:
        flag = "--batch-size" if "more than 1 value per channel" in str(err) else "--image-size"
        raise UserInputError(f"{flag} {batch_size if flag == '--batch-size' else image_size}: {name} cannot train "
                             f"on batches of {batch_size} images of {image_size} x {image_size} px "
                             f"({str(err).splitlines()[0]})") from None
    if not isinstance(output, torch.Tensor):
        raise UserInputError(f"--model {name}: its forward returns a {type(output).__name__} while training, where the "
                             "loss takes the logits alone (one tensor); make forward return them")


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
