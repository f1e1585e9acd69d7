"""``python -m rltrain.train RECIPE [key=value ...]``: the launcher-agnostic entry point.

Under ``torchrun`` (``RANK``/``WORLD_SIZE`` set by the launcher) every process runs the SPMD mode;
otherwise the recipe runs under Ray, exactly as ``rltrain train``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rltrain.train", description=__doc__)
    parser.add_argument("recipe")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--skip-env-check", action="store_true")
    args = parser.parse_args(argv)
    rank = os.environ.get("RANK")
    logging.basicConfig(
        level=logging.INFO if rank in (None, "0") else logging.WARNING,
        format=f"%(asctime)s [rank {rank or 0}] %(levelname)s %(name)s: %(message)s",
    )
    from rltrain.config import ConfigError, load_config
    from rltrain.doctor import EnvironmentMismatch, require_environment

    try:
        if not args.skip_env_check:
            require_environment()
        config = load_config(args.recipe, args.overrides)
    except (ConfigError, EnvironmentMismatch) as err:
        print(f"rltrain.train: {err}", file=sys.stderr)
        return 2
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:
        from rltrain.orchestrator.spmd import train_spmd

        train_spmd(config)
    else:
        from rltrain.orchestrator.entry import train

        train(config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
