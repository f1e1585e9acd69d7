"""``python -m rltrain.train RECIPE [key=value ...]``: the launcher-agnostic entry point.

Under ``torchrun`` (``RANK``/``WORLD_SIZE`` set by the launcher) every process runs the SPMD mode;
otherwise the recipe runs under Ray, exactly as ``rltrain train``. Each process shows rltrain's own
lines on the console (ranks other than 0: warnings only) and writes everything else to its log file
in the run directory (:mod:`rltrain.logging.console`).
"""

from __future__ import annotations

import argparse
import os
import sys

from rltrain.logging.console import start_console


def load_run_config(recipe: str, overrides: list[str], *, check_env: bool):
    """The recipe's config, after checking the installed packages (``check_env``); raises
    ``ConfigError`` or ``EnvironmentMismatch``."""
    from rltrain.config import load_config
    from rltrain.doctor import require_environment
    from rltrain.logging.console import stage

    if check_env:
        with stage("checking the installed packages"):
            require_environment()
    return load_config(recipe, overrides)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rltrain.train", description=__doc__)
    parser.add_argument("recipe")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--skip-env-check", action="store_true")
    parser.add_argument("--verbose", action="store_true", help="trainer.verbose=true")
    args = parser.parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    start_console(rank=rank)
    from rltrain.config import ConfigError
    from rltrain.doctor import EnvironmentMismatch
    from rltrain.logging.console import capture_run_output, log_path

    overrides = [*args.overrides, "trainer.verbose=true"] if args.verbose else args.overrides
    try:
        config = load_run_config(args.recipe, overrides, check_env=not args.skip_env_check)
    except (ConfigError, EnvironmentMismatch) as err:
        print(f"rltrain.train: {err}", file=sys.stderr)
        return 2
    capture_run_output(log_path(config.run_dir(), rank), verbose=config.trainer.verbose)
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:
        from rltrain.orchestrator.spmd import train_spmd

        train_spmd(config)
    else:
        from rltrain.orchestrator.entry import train

        train(config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
