"""``python -m rltrain.train RECIPE [key=value ...]``: the launcher-agnostic entry point.

Under ``torchrun`` (``RANK``/``WORLD_SIZE`` set by the launcher) every process runs the SPMD mode;
otherwise the recipe runs under Ray, exactly as ``rltrain train``. Each process shows rltrain's own
lines on the console (ranks other than 0: warnings only) and writes everything else to its log file
in the run directory (:mod:`rltrain.logging.console`).
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
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
    torchrun = "WORLD_SIZE" in os.environ and "RANK" in os.environ
    command = (
        "the same torchrun command"
        if torchrun
        else shlex.join(["python", "-m", "rltrain.train", *(argv if argv is not None else sys.argv[1:])])
    )
    return run_and_report("rltrain.train", config, resume_command=command)


def run_and_report(prog: str, config, *, resume_command: str) -> int:
    """Run ``config`` (the torchrun mode where the launcher set ``RANK``/``WORLD_SIZE``, else Ray) and
    return the exit code; a run that ends early says why in one line on the terminal (rank 0):

    * 0: the run finished;
    * 1: it stopped (:class:`~rltrain.errors.RunStopped`, a checkpoint that cannot be saved or
      resumed, a worker that failed or died: the worker's traceback and Ray's account of a death go
      to the run's log file, which the line names);
    * 2: a configuration this launcher cannot run;
    * :data:`~rltrain.trainer.preemption.PREEMPTED_EXIT_CODE` (75): SIGTERM/SIGUSR1 stopped it
      after saving; the line names the checkpoint and ``resume_command``.
    """
    from rltrain.config import ConfigError
    from rltrain.errors import RunStopped
    from rltrain.logging.console import log_path, terminal
    from rltrain.trainer.checkpoints import CheckpointError
    from rltrain.trainer.preemption import PREEMPTED_EXIT_CODE, Preempted
    from rltrain.trainer.recovery import WorkerError

    rank = int(os.environ.get("RANK", "0"))
    try:
        if "WORLD_SIZE" in os.environ and "RANK" in os.environ:
            from rltrain.orchestrator.spmd import train_spmd

            train_spmd(config)
        else:
            from rltrain.orchestrator.entry import train

            train(config)
        return 0
    except Preempted as err:
        line, code = f"{err}; resume with: {resume_command}{_resume_overrides(config)}", PREEMPTED_EXIT_CODE
    except ConfigError as err:
        line, code = str(err), 2
    except (RunStopped, CheckpointError) as err:
        line, code = str(err), 1
    except WorkerError as err:
        # the traceback: the run's log file only (the root logger does not write to the terminal)
        logging.getLogger().error("%s", getattr(err, "detail", err), exc_info=err)
        line = f"{str(err).splitlines()[0]} (details in {log_path(config.run_dir(), rank)})"
        code = 1
    if rank == 0:
        print(f"{prog}: {line}", file=terminal().err)
    return code


def _resume_overrides(config) -> str:
    """What a resume adds to the run's command: nothing with ``resume_mode: auto``; otherwise the
    overrides that make it continue from the run's checkpoints instead of refusing or deleting them."""
    trainer = config.trainer
    if trainer.resume_mode == "auto":
        return ""
    extra = " trainer.resume_mode=auto"
    return extra + (
        " trainer.checkpoint.discard_existing=false" if trainer.checkpoint.discard_existing else ""
    )


if __name__ == "__main__":
    sys.exit(main())
