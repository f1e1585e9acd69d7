"""``rltrain`` command line: thin entry points, no logic.

rltrain train RECIPE [key=value ...]        run a recipe under Ray (``--dry-run``: validate, print)
rltrain config RECIPE [key=value ...]       print the resolved config
rltrain convert MODE SRC DST [--tp/pp/ep]   HF <-> Megatron checkpoints, verified by round trip
rltrain plot RUN_DIR                        PNG of a run's main curves
rltrain checkpoint verify RUN_DIR           check a run's checkpoints against their manifests
rltrain doctor                              installed packages vs the versions this release needs

Under torchrun use ``python -m rltrain.train RECIPE``, which runs every rank without Ray.
``rltrain train`` exits 0 when the run finished, 1 when it stopped (one line says why), 2 for a
configuration error, and 75 when SIGTERM/SIGUSR1 stopped it after saving a checkpoint (resumable).
"""

from __future__ import annotations

import argparse
import logging
import shlex
import sys


def _add_recipe_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="YAML recipe (see recipes/)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. actor.optim.lr=1e-6")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rltrain", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="run a recipe")
    _add_recipe_args(train)
    train.add_argument(
        "--dry-run", action="store_true", help="validate, write and print the resolved config only"
    )
    train.add_argument(
        "--skip-env-check", action="store_true", help="do not stop on package version mismatches"
    )
    train.add_argument(
        "--verbose",
        action="store_true",
        help="also show the logs of Ray, vLLM, Megatron, ... on the console (trainer.verbose=true)",
    )
    train.set_defaults(func=_train)

    config = sub.add_parser("config", help="print the resolved config of a recipe")
    _add_recipe_args(config)
    config.set_defaults(func=_config)

    from rltrain.convert.cli import add_subparser as add_convert_subparser
    from rltrain.logging.plot import add_plot_subparser

    add_plot_subparser(sub)
    add_convert_subparser(sub)

    checkpoint = sub.add_parser("checkpoint", help="inspect a run's checkpoints")
    checkpoint_sub = checkpoint.add_subparsers(dest="checkpoint_command", required=True)
    verify = checkpoint_sub.add_parser(
        "verify",
        help="check every checkpoint's files against its manifest (sizes, checksums) without loading models",
    )
    verify.add_argument(
        "run_dir", help="a run directory, its checkpoints/ folder, or one step_<n> checkpoint"
    )
    verify.set_defaults(func=_verify_checkpoints)

    doctor = sub.add_parser("doctor", help="check installed packages against this release")
    doctor.add_argument(
        "--profile", choices=["cpu", "gpu"], help="check for this profile instead of detecting it"
    )
    doctor.set_defaults(func=_doctor)
    return parser


def _train(args: argparse.Namespace) -> int:
    from rltrain.logging.console import capture_run_output, log_path, start_console

    start_console()  # the first line comes before the slow imports
    from rltrain.config import dump_yaml, write_resolved
    from rltrain.train import load_run_config

    overrides = [*args.overrides, "trainer.verbose=true"] if args.verbose else args.overrides
    config = load_run_config(args.recipe, overrides, check_env=not args.skip_env_check)
    path = write_resolved(config, config.run_dir(), source=args.recipe)
    if args.dry_run:
        print(dump_yaml(config))
        print(f"resolved config written to {path}")
        return 0
    capture_run_output(log_path(config.run_dir()), verbose=config.trainer.verbose)
    from rltrain.train import run_and_report

    flags = ["--skip-env-check"] if args.skip_env_check else []
    command = shlex.join(["rltrain", "train", *flags, args.recipe, *args.overrides])
    return run_and_report("rltrain train", config, resume_command=command)


def _config(args: argparse.Namespace) -> int:
    from rltrain.config import dump_yaml, load_config

    print(dump_yaml(load_config(args.recipe, args.overrides)), end="")
    return 0


def _verify_checkpoints(args: argparse.Namespace) -> int:
    """Exit 0 when every checkpoint verifies and ``latest`` names one of them; 1 otherwise."""
    from rltrain.trainer.checkpoints import verify_path

    lines, all_well = verify_path(args.run_dir)
    print("\n".join(lines))
    return 0 if all_well else 1


def _doctor(args: argparse.Namespace) -> int:
    from rltrain.doctor import main as doctor_main

    return doctor_main(args.profile)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    from rltrain.config import ConfigError
    from rltrain.doctor import EnvironmentMismatch
    from rltrain.errors import RunStopped
    from rltrain.logging.console import terminal
    from rltrain.trainer.checkpoints import CheckpointError

    try:
        return args.func(args)
    except (ConfigError, EnvironmentMismatch) as err:
        print(f"rltrain {args.command}: {err}", file=terminal().err)
        return 2
    except (CheckpointError, RunStopped) as err:  # a run that cannot go on: one line naming why
        print(f"rltrain {args.command}: {err}", file=terminal().err)
        return 1


if __name__ == "__main__":
    sys.exit(main())
