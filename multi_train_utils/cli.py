"""The command line shared by the three scripts: the tutorial's flags, real booleans, checked ranges; and
`run_cli`, through which every script runs. docs/flags.md lists every flag (tests/test_readme.py checks it by
name)."""

from __future__ import annotations

import argparse
import atexit
import contextlib
import dataclasses
import gc
import math
import os
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal, NoReturn
from urllib.parse import urlparse

from .checkpoint import BEST_METRICS
from .config import RunConfig, bound_change, saved_values
from .distributed_utils import COMM_HOOKS, DIST_TIMEOUT_S
from .errors import UserInputError, hold_back_ctrl_c, listen_for_stop_signals, path_kind
from .files import check_readable_file
from .launch import CHECK_COLLECTIVES_VARIABLE, Launch, detect_launch, stop_when_launcher_dies, usable_cpus
from .optim import AMP_CHOICES, OPTIMIZERS, SCHEDULES
from .recorder import trained_flags
from .shutdown import end_run

Launcher = Literal["single", "launch", "spawn"]

# Without --data-path the scripts train on the small demo data, on which these finish in minutes on a
# laptop CPU; on your own photographs the tutorial's values apply.
DEMO_DEFAULTS = {"epochs": 16, "batch_size": 32, "image_size": 32, "lr": 0.002}
DATA_DEFAULTS = {"epochs": 30, "batch_size": 16, "image_size": 224, "lr": 0.001}
DEFAULT_MODEL = "resnet34"


def str2bool(text: str) -> bool:
    """`--syncBN False` means False (argparse's type=bool would call any non-empty string True)."""
    value = text.strip().lower()
    if value in ("1", "true", "yes", "y", "on"):
        return True
    if value in ("0", "false", "no", "n", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def at_least(low: int, at_most: int | None = None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        if at_most is not None and value > at_most:
            raise argparse.ArgumentTypeError(f"must be at most {at_most}, got {value}")
        return value

    parse.__name__ = f"integer >= {low}"
    return parse


def epochs_kept(text: str) -> int | None:
    """How many epochs' weights to keep: a number, or all (None); true and false as the flag once took them."""
    if text.strip().lower() in ("all", "true"):
        return None
    return 0 if text.strip().lower() == "false" else at_least(0, 10**6)(text)


def path_text(text: str) -> str:
    """A path, not an empty string: `--data-path "$DATA"` with DATA unset would train on the demo data, and
    `--output-dir ""` write into the current folder, each without a word."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"expected a path, got {text!r} (a variable that is not set?)")
    return text


def positive_float(text: str, at_most: float = math.inf, zero: bool = False, least: float = 0.0) -> float:
    """A finite number above 0 (or 0 itself, with `zero`), at least `least` (where the program cannot use less)
    and at most `at_most`: "inf" and "nan" parse as floats, but train nothing."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero):
        raise argparse.ArgumentTypeError(f"must be a finite number {'of 0 or more' if zero else 'above 0'}, got {text}")
    if value < least and value != 0:
        raise argparse.ArgumentTypeError(f"must be {'0 or ' if zero else ''}at least {least:g}, got {text}")
    if value > at_most:
        raise argparse.ArgumentTypeError(f"must be at most {at_most:g}, got {text}")
    return value


def non_negative_float(text: str, at_most: float = math.inf, least: float = 0.0) -> float:
    """A finite number, 0 or from `least` up to `at_most`."""
    return positive_float(text, at_most, zero=True, least=least)


def fraction(text: str) -> float:
    return positive_float(text, at_most=1.0)


class DefaultsOnceFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Adds "(default: X)" to a flag's help, unless its help already says what the default is."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default in (None, "") or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


class OneLineErrorParser(argparse.ArgumentParser):
    """Reports a bad flag in one line, like every other mistake, instead of the whole usage first."""

    def error(self, message: str) -> NoReturn:
        raise UserInputError(f"{message} (see {self.prog} --help)")


def below_one(text: str) -> float:
    """A finite number from 0 up to, not including, 1 (a label smoothing of 1 would leave no target)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 <= value < 1:  # also false for nan
        raise argparse.ArgumentTypeError(f"must be at least 0 and below 1, got {text}")
    return value


def decay(text: str) -> float:
    """A finite number above 0 and below 1: 1 would never move the average, 0 would make it the weights."""
    value = below_one(text)
    if value == 0.0:
        raise argparse.ArgumentTypeError(f"must be above 0, got {text}")
    return value


# Far beyond what is useful, short of what exhausts a machine or overflows the arithmetic they feed (the lr
# is multiplied by the processes and the accumulated batches, then by float32 gradients): a typo.
MAX_IMAGE_SIZE = 4096
MAX_LR = 1e6
# Beta(alpha, alpha) draws a share, MixUp's and CutMix's; below 0.001 its float32 samples fail or come out 0.5.
ALPHA = partial(non_negative_float, at_most=100.0, least=0.001)
MAX_SEED = 2**31 - 1  # NumPy takes seeds up to 2**32 - 1, and each rank adds its rank
WORKERS_PER_CPU = 4


BOOLEAN = {"type": str2bool, "nargs": "?", "const": True}  # --flag, --flag true, --flag false
# A 16-epoch run that kept every epoch's ResNet-34 weights wrote 1.6 GB; the newest few are what people use.
KEPT_EPOCH_WEIGHTS = 3


def on_the_demo_data(name: str) -> str:
    return f"(default {DATA_DEFAULTS[name]}; {DEMO_DEFAULTS[name]} on the demo data)"


def default_weight_decays() -> str:
    return ", ".join(f"{name} {decay:g}" for name, (_, _, decay) in OPTIMIZERS.items())


# The flags, as argparse takes them (names, then add_argument's keywords): those of every script, then those of
# the multi-process ones, of the spawn script and of the launch script. get_args_parser builds each parser from
# them; docs/flags.md lists every flag (a test checks it by name).
FLAGS = {
    # the data
    "--data-path": dict(type=path_text, default=None, help="folder with one sub-folder of images per class (or "
                        "train/ and val/ folders of class sub-folders); without it, the built-in demo data"),
    "--num_classes": dict(type=at_least(2), default=None, help="number of classes (default: from the data)"),
    "--image-size": dict(type=at_least(16, MAX_IMAGE_SIZE), default=None, help="side of the square training crop "
                         f"in pixels {on_the_demo_data('image_size')[:-1]}; a resumed or validated run keeps its own)"),
    "--workers": dict(type=at_least(0, WORKERS_PER_CPU * usable_cpus()), default=None, help="data-loader processes "
                      "per training process (default on GPUs: this process's share of the CPUs it may use, less "
                      "one, at most 16; on CPUs: a quarter of that share, at most 4, so none on small CPUs)"),
    "--decode-on": dict(choices=("cpu", "gpu"), default="cpu", help="gpu: the loader workers only read the "
                        "training JPEGs; the GPU decodes and augments them (nvjpeg; on a CPU this falls back to "
                        "cpu, with a notice)"),
    "--seed": dict(type=at_least(0, MAX_SEED), default=0, help="seed for the split, the initial weights and the "
                   "data order"),
    # training
    "--epochs": dict(type=at_least(1, 1_000_000), default=None, help=f"epochs to train {on_the_demo_data('epochs')}"),
    "--batch-size": dict(type=at_least(1, 65536), default=None, help="images per batch in each process "
                         f"{on_the_demo_data('batch_size')}"),
    "--lr": dict(type=partial(positive_float, at_most=MAX_LR), default=None, help="learning rate for one process; "
                 f"multiplied by the number of processes {on_the_demo_data('lr')}"),
    "--opt": dict(default="sgd", choices=tuple(OPTIMIZERS), help="the optimizer (optim.py: SGD with momentum 0.9, "
                  "or AdamW)"),
    "--weight-decay": dict(type=partial(non_negative_float, at_most=10.0), default=None, help="weight decay of the "
                           "weights of convolutions and linear layers; biases and normalisation layers get none "
                           f"(default: {default_weight_decays()})"),
    "--sched": dict(default="cosine", choices=tuple(SCHEDULES), help="the lr schedule after the warm-up, stepped "
                    "every optimizer step: cosine down to --lrf x --lr, a tenth as large after each third of "
                    "training, or constant"),
    "--lrf": dict(type=fraction, default=0.1, help="--sched cosine: the final lr as a fraction of --lr"),
    "--warmup-epochs": dict(type=at_least(0), default=0, help="epochs of linear lr warm-up before the schedule, "
                            "rising every optimizer step"),
    "--model": dict(default=None, help="a model registered in model.py, any torchvision classification model, or "
                    f"timm/NAME where timm is installed, by name (default {DEFAULT_MODEL}; a resumed or validated run "
                    "keeps its own)"),
    "--weights": dict(default="", help="starting weights: a .pth file, or a published weights name such as "
                      "DEFAULT (torchvision's, or timm's for timm/NAME; downloads)"),
    "--freeze-layers": dict(**BOOLEAN, default=False, help="train only the classifier (true/false)"),
    "--unfreeze-epoch": dict(type=at_least(1), default=None, help="with --freeze-layers: from this epoch on, every "
                             "layer trains (default: the classifier alone, always)"),
    "--device": dict(default="auto", help="auto (CUDA when present), cpu, cuda or cuda:N; or, for one process, mps "
                     "(Apple GPUs)"),
    # opt-in tricks of torchvision's references and timm; off, the step is the tutorial's
    "--label-smoothing": dict(type=below_one, default=0.0, help="the target of the loss: 1 - s on the true class, s "
                              "spread evenly over all classes (0: off; 0.1 is usual)"),
    "--mixup-alpha": dict(type=ALPHA, default=0.0, help="MixUp: each training batch blends pairs of images and "
                          "their labels by a share drawn from Beta(alpha, alpha) (0: off; 0.2 is usual)"),
    "--cutmix-alpha": dict(type=ALPHA, default=0.0, help="CutMix: a box of one training image pasted into another, "
                           "the labels mixed by its area (0: off; 1.0 is usual); with --mixup-alpha as well, one of "
                           "the two for each batch"),
    "--clip-grad-norm": dict(type=partial(positive_float, at_most=1e6), default=None, help="scale the gradients "
                             "down where their total L2 norm exceeds this (default: no limit)"),
    "--model-ema": dict(**BOOLEAN, default=False, help="also keep, validate and save a moving average of the "
                        "weights (weights/best_ema.pth; true/false)"),
    "--model-ema-decay": dict(type=decay, default=0.999, help="the average's decay per batch of one process; each "
                              "optimizer step decays it as many times as it has batches (processes x "
                              "--accum-steps)"),
    # speed
    "--amp": dict(nargs="?", const="auto", default="off", choices=AMP_CHOICES, help="mixed precision: bf16 or fp16 "
                  "autocast (fp16 with loss scaling, CUDA only); auto or the bare flag: bf16 where the device "
                  "computes in it, else fp16 on a GPU and float32 on a CPU"),
    "--channels-last": dict(**BOOLEAN, default=False, help="channels-last (NHWC) memory format for the model and "
                            "the images (true/false)"),
    "--compile": dict(**BOOLEAN, default=False, help="torch.compile the model (minutes of compiling first; "
                      "true/false)"),
    "--accum-steps": dict(type=at_least(1, 1024), default=1, help="batches whose gradients add up before each "
                          "optimizer step (the lr is multiplied by it too)"),
    # what the run writes
    "--output-dir": dict(type=path_text, default="output", help="folder for everything the run writes"),
    "--save-every": dict(type=at_least(1), default=1, help="write the checkpoint every N epochs (and after the "
                         "last); a resume goes back to the last one"),
    "--keep-epoch-weights": dict(type=epochs_kept, default=KEPT_EPOCH_WEIGHTS, help="keep weights/model-{epoch}.pth "
                                 "of the newest N epochs, and the best epoch's (all: every epoch; 0: only best.pth "
                                 "and the checkpoint)"),
    "--best-metric": dict(default="val_acc", choices=tuple(BEST_METRICS), help="what makes weights/best.pth (and "
                          "best_ema.pth) the best: the highest val_acc or the lowest val_loss"),
    "--checkpoint-every-steps": dict(type=at_least(1), default=None, help="also write the checkpoint inside "
                                     "epochs, every N optimizer steps (default: only after epochs)"),
    "--checkpoint-every-minutes": dict(type=partial(positive_float, at_most=1e6), default=None, help="also write "
                                       "the checkpoint inside epochs, once M minutes have passed since the last one"),
    "--stop-grace": dict(type=partial(positive_float, at_most=86400), default=20.0, help="seconds after a SIGTERM "
                         "that a process may take to reach its next step and save it; one that has not by then "
                         "stops without saving, before the scheduler kills it (SLURM, Kubernetes and torchrun kill "
                         "30 s after SIGTERM by default)"),
    "--keep-checkpoints": dict(type=at_least(1, 1000), default=1, help="how many of the newest checkpoints to keep: "
                               "checkpoint.pth, and the K-1 before it in checkpoints/"),
    "--resume": dict(type=path_text, default=None, help="checkpoint to continue from, or auto: the one in "
                     "--output-dir if there is one (an attempt that torchrun restarted does this by itself)"),
    "--eval-only": dict(**BOOLEAN, default=False, help="train nothing: validate --weights (default: --output-dir's "
                        "weights/best.pth) once on the run's validation split, and print the result as one JSON "
                        "line (true/false)"),
}
MULTI_PROCESS_FLAGS = {
    "--syncBN": dict(**BOOLEAN, default=False, help="SyncBatchNorm: BatchNorm statistics over the global batch "
                     "(CUDA only; true/false)"),
    "--bucket-cap-mb": dict(type=partial(positive_float, at_most=4096), default=25.0, help="size of DDP's gradient "
                            "buckets: each bucket is all-reduced as soon as its gradients are ready"),
    "--comm-hook": dict(default="none", choices=COMM_HOOKS, help="send the gradients as 16-bit numbers (half the "
                        "bytes per all-reduce)"),
    "--dist-url": dict(default="env://", help="how processes find each other: env:// reads MASTER_ADDR/PORT, or "
                       "tcp://HOST:PORT, file://PATH"),
    "--dist-timeout": dict(type=partial(positive_float, at_most=1e6, least=1.0), default=DIST_TIMEOUT_S,
                           help="seconds a collective may wait for the other processes before the job fails (at "
                           "least 1: the processes need that to meet)"),
    "--check-collectives": dict(**BOOLEAN, default=False, help="check at each collective that every process calls "
                                "the same one, and stop at the first that differs, naming each process's call "
                                "(PyTorch's TORCH_DISTRIBUTED_DEBUG=DETAIL: slower; for finding a hang; true/false)"),
}
SPAWN_FLAGS = {"--world-size": dict(type=at_least(1), default=None, help="number of processes to start (default: "
                                    "one per visible GPU, or 2 on CPU)")}
# The legacy `python -m torch.distributed.launch` (without --use_env) passes this; LOCAL_RANK in the environment
# says the same, and is what we read.
LAUNCH_FLAGS = {"--local-rank --local_rank": dict(type=int, default=None, help=argparse.SUPPRESS)}
FLAGS_OF = {"single": (FLAGS,), "launch": (FLAGS, MULTI_PROCESS_FLAGS, LAUNCH_FLAGS),
            "spawn": (FLAGS, MULTI_PROCESS_FLAGS, SPAWN_FLAGS),
            "every": (FLAGS, MULTI_PROCESS_FLAGS, SPAWN_FLAGS, LAUNCH_FLAGS)}  # every field of a RunConfig
NOT_GIVEN = object()


def get_args_parser(launcher: Launcher | Literal["every"], add_help: bool = True,
                    defaults: bool = True) -> argparse.ArgumentParser:
    """The flags of one script, multi-process flags only where they apply; without `defaults`, each is NOT_GIVEN
    unless given."""
    parser = OneLineErrorParser(add_help=add_help, formatter_class=DefaultsOnceFormatter)
    for flags in FLAGS_OF[launcher]:
        for names, options in flags.items():
            parser.add_argument(*names.split(), **(options if defaults else {**options, "default": NOT_GIVEN}))
    return parser


def parse_args(launcher: Launcher, argv: Sequence[str] | None = None) -> RunConfig:
    """The run's configuration: the flags given; for a resumed (or validated) run, the saved run's values of the
    others (config.saved_values); then the defaults, some of which depend on whether the demo data is used."""
    values = vars(get_args_parser("every").parse_args([])) | vars(get_args_parser(launcher).parse_args(argv))
    probe = get_args_parser(launcher, add_help=False, defaults=False)  # one given its default is given all the same
    given = {name for name, value in vars(probe.parse_args(argv)).items() if value is not NOT_GIVEN}
    if values["eval_only"]:
        values["resume"] = values["resume"] or "auto"  # the run's own split, found through its checkpoint
    saved = trained_flags(values["resume"], values["output_dir"])
    if saved:
        values = saved_values(values, saved, given)
    defaults = {"model": DEFAULT_MODEL, **(DATA_DEFAULTS if values["data_path"] else DEMO_DEFAULTS)}
    values |= {name: default for name, default in defaults.items() if values[name] is None}
    if values["eval_only"] and "weights" not in given:  # the run's best weights
        values["weights"] = str(Path(values["output_dir"]) / "weights" / "best.pth")
    config = RunConfig(**values)
    problem = flag_combination_problem(config, given, launcher)
    if not problem and saved and not config.eval_only:
        problem = bound_change(config, saved)
    if problem:
        raise UserInputError(problem)
    return config


def default_config(launcher: Launcher = "single", **changes: Any) -> RunConfig:
    """A fresh run's configuration with the default flags, and `changes`: for a run made in code."""
    return dataclasses.replace(parse_args(launcher, []), **changes)


def flag_combination_problem(config: RunConfig, given: set[str], launcher: Launcher) -> str | None:
    """What is wrong with flags that are each fine alone, or None."""
    if config.syncBN and config.compile:
        # torch.compile breaks its graph at every SyncBatchNorm, so the pair is slower than either alone.
        return ("--syncBN with --compile: torch.compile breaks its graph at every SyncBatchNorm layer, which "
                "costs more than compiling saves; use one of the two")
    if config.warmup_epochs >= config.epochs:
        return f"--warmup-epochs {config.warmup_epochs}: must be fewer than --epochs {config.epochs}"
    if config.unfreeze_epoch is not None and not config.freeze_layers:
        return f"--unfreeze-epoch {config.unfreeze_epoch}: there is nothing to unfreeze without --freeze-layers"
    if config.unfreeze_epoch is not None and config.unfreeze_epoch >= config.epochs:
        return (f"--unfreeze-epoch {config.unfreeze_epoch}: must be below --epochs {config.epochs}, or no epoch "
                "would train every layer")
    if "lrf" in given and config.sched != "cosine":
        return f"--lrf {config.lrf:g}: the final lr of --sched cosine; --sched {config.sched} has none"
    if config.device == "mps" and launcher != "single":
        return ("--device mps: DistributedDataParallel has no backend for Apple GPUs; train on one with "
                "train_single_gpu.py --device mps")
    if not config.dist_url.startswith(("env://", "tcp://", "file://")):
        return f"--dist-url {config.dist_url}: expected env://, tcp://HOST:PORT or file://PATH"
    return None


@contextlib.contextmanager
def ends_in_one_line(rank: int, config: RunConfig | None = None,
                     watch_launcher: bool = False) -> Iterator[SimpleNamespace]:
    """Run the block as one process of a job, which end_run ends in one line however it ends early (with
    `watch_launcher`, also when the launcher dies). The block may set the run's `config` it yields, once known."""
    listen_for_stop_signals()
    atexit.unregister(gc.freeze)  # once, however many runs a process makes
    atexit.register(gc.freeze)  # Python's last collections, at exit, would walk every object torch made (0.7 s)
    if watch_launcher:
        stop_when_launcher_dies()
    ending = SimpleNamespace(config=config)  # where the run's last checkpoint is, and what it asked of memory
    try:
        hold_back_ctrl_c(False)  # a Ctrl-C held back while a spawned process imported arrives now (spawn_utils)
        yield ending
    except BaseException as err:
        end_run(err, rank, ending.config)


def run_cli(main: Callable[[RunConfig], None], launcher: Launcher,
            argv: Sequence[str] | None = None) -> None:
    """Parse the flags, check them against the files, run `main`; however it ends early, it ends in one line
    (ends_in_one_line)."""
    launch = Launch(0, 0, 1, 1, "single")
    if launcher == "launch" or {"WORLD_SIZE", "SLURM_STEP_NUM_TASKS"} & set(os.environ):  # torchrun's, srun's
        with contextlib.suppress(UserInputError):  # a launcher's variables that do not fit: main() meets them too
            launch = detect_launch(os.environ)  # this process may be any rank of a launcher's job
    under_a_launcher = launcher == "launch" and launch.source != "single"  # and the launcher may die first
    with ends_in_one_line(launch.rank, watch_launcher=under_a_launcher) as ending:
        args = parse_args(launcher, argv)
        ending.config = args  # the stop line names the run's last checkpoint
        refuse_the_wrong_launcher(launcher, launch)
        check_before_start(args)
        if args.check_collectives:  # read by PyTorch where the processes meet (launch.record_collectives)
            os.environ[CHECK_COLLECTIVES_VARIABLE] = "DETAIL"
        main(args)


def refuse_the_wrong_launcher(launcher: Launcher, launch: Launch) -> None:
    """A script started as one of several processes by torchrun or srun that starts none (or its own): each
    would train alone, into one folder, or two spawn jobs would meet on one port."""
    if launcher != "launch" and launch.world_size > 1:
        by = "srun" if launch.source == "slurm" else "torchrun"
        script = ("train_single_gpu.py trains in one process" if launcher == "single" else
                  "train_multi_gpu_using_spawn.py starts its processes itself")
        raise UserInputError(f"{script}, but {by} started it as one of {launch.world_size}: start "
                             f"train_multi_gpu_using_launch.py with {by} instead")


def check_before_start(args: RunConfig) -> None:
    """That the files named are files and --dist-url a place to meet (the model and data are checked where read)."""
    if path_kind(Path(args.output_dir), "--output-dir") not in ("missing", "folder"):
        raise UserInputError(f"--output-dir {args.output_dir}: is a file; the run writes a folder there")
    if args.data_path and Path(args.output_dir).resolve().is_relative_to(Path(args.data_path).resolve()):
        raise UserInputError(f"--output-dir {args.output_dir}: inside --data-path {args.data_path}, where the next "
                             "run would read it as a class of images; choose a folder outside the data")
    if args.eval_only and path_kind(Path(args.weights), "--weights") != "file":
        raise UserInputError(f"--eval-only: no weights file {args.weights}; name the weights to validate "
                             "with --weights, or the run's folder with --output-dir")
    if args.resume not in (None, "auto"):
        check_readable_file(Path(args.resume), "--resume")
    if args.dist_url.startswith("file://"):
        check_meeting_file(args.dist_url)
    elif args.dist_url.startswith("tcp://"):
        check_meeting_address(args.dist_url)


def check_meeting_address(dist_url: str) -> None:
    """--dist-url tcp://HOST:PORT names both. PyTorch meets a missing or misspelt one with a traceback, and port 0
    with a wait for ever: rank 0 listens on a port of its own choosing, which no other rank knows."""
    url = urlparse(dist_url)
    try:
        port = url.port
    except ValueError:  # not a number, or above 65535
        port = None
    if not url.hostname or not port:
        raise UserInputError(f"--dist-url {dist_url}: expected tcp://HOST:PORT, rank 0's address and a free port "
                             "from 1 to 65535 (such as tcp://10.0.0.1:29500)")


def check_meeting_file(dist_url: str) -> None:
    """--dist-url file://PATH: every process must be able to create that file. In a folder that is not there they
    would wait for ever: PyTorch's file store retries, whatever --dist-timeout says."""
    path = Path(urlparse(dist_url).path)  # as PyTorch reads it
    if not path.name or path_kind(path, "--dist-url") not in ("missing", "file"):
        raise UserInputError(f"--dist-url {dist_url}: names no file; use file:///FOLDER/NAME, with a folder that "
                             "every machine sees")
    if path_kind(path.parent, "--dist-url") != "folder":
        raise UserInputError(f"--dist-url {dist_url}: there is no folder {path.parent}; create it (on a file system "
                             "every machine sees), or use env://")
