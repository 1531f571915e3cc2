"""What a run is: every flag of the command line as one typed, frozen value, made once by cli.parse_args and passed
to whatever needs it; and, flag by flag, what a resumed run does with it (ON_RESUME).

A checkpoint keeps the run's configuration. A resumed run starts from it: a flag not given again keeps the run's
value, and a flag given again with another value is
- bound to the run: refused, in one line, since the run would no longer be the one its checkpoint continues;
- applied: from the step where the run goes on, said in one line, and kept in the checkpoints from then on;
- this command only: how and where this command runs, and what it writes; never taken from the saved run (a flag
  not given has its default).
A flag of your own that ON_RESUME does not name is applied, and said.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any


@dataclass(frozen=True)
class RunConfig:
    """Every flag's value, by the flag's name with - as _ (docs/flags.md says what each one does)."""

    # the data
    data_path: str | None
    num_classes: int | None
    image_size: int
    workers: int | None
    decode_on: str
    seed: int
    # training
    epochs: int
    batch_size: int
    lr: float
    opt: str
    weight_decay: float | None
    sched: str
    lrf: float
    warmup_epochs: int
    model: str
    weights: str
    freeze_layers: bool
    unfreeze_epoch: int | None
    device: str
    label_smoothing: float
    mixup_alpha: float
    cutmix_alpha: float
    clip_grad_norm: float | None
    model_ema: bool
    model_ema_decay: float
    amp: str
    channels_last: bool
    compile: bool
    accum_steps: int
    # what the run writes
    output_dir: str
    save_every: int
    keep_epoch_weights: int | None  # None: every epoch's
    best_metric: str
    checkpoint_every_steps: int | None
    checkpoint_every_minutes: float | None
    stop_grace: float
    keep_checkpoints: int
    resume: str | None
    eval_only: bool
    # several processes (the one-process script has their defaults)
    syncBN: bool  # the tutorial's spelling
    bucket_cap_mb: float
    comm_hook: str
    dist_url: str
    dist_timeout: float
    check_collectives: bool
    world_size: int | None
    local_rank: int | None

    def as_saved(self) -> dict[str, Any]:
        """The configuration as a checkpoint keeps it: plain values that torch.load(weights_only=True) reads."""
        return asdict(self)


BOUND, APPLIED, THIS_COMMAND = "bound to the run", "applied", "this command only"
# Each flag's rule on resume, and why: the one table of them (docs/long-runs.md shows it, docs/generate.py writes it).
ON_RESUME: dict[str, tuple[str, str]] = {
    "model": (BOUND, "the checkpoint's weights fit this model alone"),
    "seed": (BOUND, "the split and the order of the images come from it"),
    "opt": (BOUND, "the checkpoint's optimizer state is this optimizer's"),
    "weights": (BOUND, "the weights the run started from; it goes on from its checkpoint's"),
    "data_path": (APPLIED, "where the images are now: the run keeps its classes and its split of them"),
    "image_size": (APPLIED, "training and validation crop to the new size"),
    "epochs": (APPLIED, "the schedule stretches or shrinks to end at the new last epoch"),
    "batch_size": (APPLIED, "the epoch goes on after the images already trained on, in batches of the new size"),
    "lr": (APPLIED, "the schedule is rescaled: the next step trains at the new schedule's lr"),
    "weight_decay": (APPLIED, "the optimizer decays by the new value"),
    "sched": (APPLIED, "the lr follows the new schedule from the next step"),
    "lrf": (APPLIED, "the lr follows the new schedule from the next step"),
    "warmup_epochs": (APPLIED, "the lr follows the new schedule from the next step"),
    "freeze_layers": (APPLIED, "which layers train is set anew at every epoch's start"),
    "unfreeze_epoch": (APPLIED, "which layers train is set anew at every epoch's start"),
    "label_smoothing": (APPLIED, "the loss of the next step takes it"),
    "mixup_alpha": (APPLIED, "the next batch is mixed by it"),
    "cutmix_alpha": (APPLIED, "the next batch is mixed by it"),
    "clip_grad_norm": (APPLIED, "the next step clips by it"),
    "model_ema": (APPLIED, "switched on, the average starts from the resumed weights; off, the saved one is dropped"),
    "model_ema_decay": (APPLIED, "the average decays by it from the next step"),
    "amp": (APPLIED, "the next step computes in the new precision"),
    "accum_steps": (APPLIED, "the next optimizer step gathers the new number of batches (and the lr follows)"),
    "syncBN": (APPLIED, "BatchNorm normalises over the new batch from the next step"),
    "comm_hook": (APPLIED, "the next all-reduce sends the gradients so"),
    "best_metric": (APPLIED, "best.pth is judged by it from the next epoch on"),
    "num_classes": (THIS_COMMAND, "a check of the data; the run keeps its classes"),
    "output_dir": (THIS_COMMAND, "where this command writes"),
    "resume": (THIS_COMMAND, "which checkpoint this command continues"),
    "eval_only": (THIS_COMMAND, "what this command does"),
    "save_every": (THIS_COMMAND, "what this command writes"),
    "keep_epoch_weights": (THIS_COMMAND, "what this command writes"),
    "checkpoint_every_steps": (THIS_COMMAND, "what this command writes"),
    "checkpoint_every_minutes": (THIS_COMMAND, "what this command writes"),
    "keep_checkpoints": (THIS_COMMAND, "what this command writes"),
    "stop_grace": (THIS_COMMAND, "how this command stops"),
    "device": (THIS_COMMAND, "where this command computes"),
    "workers": (THIS_COMMAND, "how this command loads the images"),
    "decode_on": (THIS_COMMAND, "how this command loads the images"),
    "compile": (THIS_COMMAND, "how this command computes the same numbers"),
    "channels_last": (THIS_COMMAND, "how this command computes the same numbers"),
    "bucket_cap_mb": (THIS_COMMAND, "how this command computes the same numbers"),
    "world_size": (THIS_COMMAND, "how many processes this command starts; under any launcher, another number is said "
                   "(the rest of the epoch is dealt among them, and the lr follows)"),
    "dist_url": (THIS_COMMAND, "where this command's processes meet"),
    "dist_timeout": (THIS_COMMAND, "how long this command's processes wait for each other"),
    "check_collectives": (THIS_COMMAND, "how this command checks its processes' collectives"),
    "local_rank": (THIS_COMMAND, "set by the legacy launcher; LOCAL_RANK says the same"),
}
OWN_FLAG = (APPLIED, "a flag of your own: applied, and said")


def rule_of(name: str) -> tuple[str, str]:
    """(the rule, why) of the flag whose value is the field `name`."""
    return ON_RESUME.get(name, OWN_FLAG)


def flag_name(name: str) -> str:
    """The flag of the field `name`: its words joined by -, but for the tutorial's --num_classes."""
    return f"--{name}" if name == "num_classes" else "--" + name.replace("_", "-")


def shown(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return str(value).lower()
    return f"{value:g}" if isinstance(value, float) else str(value) or '""'


def saved_values(config: Mapping[str, Any], saved: Mapping[str, Any], given: set[str]) -> dict[str, Any]:
    """`config`'s values, where each flag not `given` on the command line keeps the saved run's value, unless it is
    this command's alone."""
    return {name: saved[name] if name in saved and name not in given and rule_of(name)[0] != THIS_COMMAND else value
            for name, value in config.items()}


def bound_change(config: RunConfig, saved: Mapping[str, Any]) -> str | None:
    """What is wrong with resuming the run of `saved` (its configuration) with `config`: a flag bound to the run
    given another value; None if there is none."""
    for name, value in asdict(config).items():
        rule, why = rule_of(name)
        if rule == BOUND and name in saved and saved[name] != value:
            return (f"{flag_name(name)} {shown(value)}: the run trained with {flag_name(name)} {shown(saved[name])}, "
                    f"and a run keeps it ({why}); resume without the flag, or train a new run in another --output-dir")
    return None


def applied_changes(config: RunConfig, saved: Mapping[str, Any]) -> list[str]:
    """The flags whose new value a resumed run applies, each as "--flag saved -> new"."""
    return [f"{flag_name(name)} {shown(saved[name])} -> {shown(value)}" for name, value in asdict(config).items()
            if rule_of(name)[0] == APPLIED and name in saved and saved[name] != value]


def field_names() -> list[str]:
    return [field.name for field in fields(RunConfig)]
