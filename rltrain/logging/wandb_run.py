"""The ``wandb`` metrics backend (``trainer.logger: [..., wandb]``): each step's metrics as a row of
one Weights & Biases run.

Contract:

* the run: project ``trainer.project_name``, name ``trainer.experiment_name``, the resolved config as
  its config; its files in ``<run dir>/wandb/`` (``offline-run-*`` or ``run-*``). A resumed or
  restarted process starts a new W&B run of the same project and name;
* the mode (``trainer.wandb_mode``, :func:`resolve_mode`): ``offline`` never touches the network (W&B's
  error reporting is switched off too, ``WANDB_ERROR_REPORTING=false``); ``auto``, the default, is
  ``offline`` unless ``WANDB_MODE`` or ``WANDB_API_KEY`` says otherwise;
* each :meth:`WandbBackend.log` is one history row holding the metrics and ``step``, the x-axis of
  every metric (W&B's own step counter only counts rows), so rows of a step logged again after a
  restart are kept, not dropped as out of order;
* :meth:`WandbBackend.close` returns once the run is on disk (or, online, sent);
* W&B's output: its capture of the console is off (``console="off"``: the run's log file already
  holds the process's output); its messages go to ``sys.stderr``, in a run the run's log file
  (:mod:`rltrain.logging.console`), never the terminal.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from rltrain.errors import RunStopped

if TYPE_CHECKING:
    from rltrain.config import RLConfig

WANDB_DIR = "wandb"
"""W&B's folder in the run directory."""

STEP_KEY = "step"
"""The history key holding the global step (every metric's x-axis)."""

Mode = Literal["auto", "online", "offline"]


@dataclass(frozen=True)
class WandbOptions:
    """What the W&B run is called and how it syncs."""

    project: str
    """``trainer.project_name``."""

    name: str
    """``trainer.experiment_name``."""

    mode: Mode = "auto"
    """``trainer.wandb_mode``."""

    config: Mapping[str, Any] | None = None
    """The resolved config, as plain data (the run's config panel); None: none."""

    @classmethod
    def of(cls, config: RLConfig) -> WandbOptions:
        from rltrain.config.loader import to_plain

        trainer = config.trainer
        return cls(
            project=trainer.project_name,
            name=trainer.experiment_name,
            mode=trainer.wandb_mode,
            config=to_plain(config),
        )


def resolve_mode(mode: Mode, environ: Mapping[str, str]) -> str:
    """The mode W&B runs in: ``mode`` itself unless ``auto``; ``auto`` is ``WANDB_MODE`` when set,
    else ``online`` when ``WANDB_API_KEY`` is set, else ``offline`` (no key: no network)."""
    if mode != "auto":
        return mode
    if environ.get("WANDB_MODE"):
        return environ["WANDB_MODE"]
    return "online" if environ.get("WANDB_API_KEY") else "offline"


class WandbBackend:
    """One W&B run, written under ``<run_dir>/wandb/``."""

    def __init__(self, run_dir: str | Path, options: WandbOptions) -> None:
        try:
            import wandb
        except ImportError:
            from rltrain.requirements import WANDB

            raise RunStopped(
                f"trainer.logger includes wandb, but the wandb package is not installed: pip install '{WANDB}'"
            ) from None
        self.mode = resolve_mode(options.mode, os.environ)
        if self.mode in ("offline", "disabled"):
            os.environ["WANDB_ERROR_REPORTING"] = "false"  # the wandb-core service reads it at start
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        try:
            self.run = wandb.init(
                project=options.project,
                name=options.name,
                dir=str(self.dir),
                mode=self.mode,
                config=dict(options.config) if options.config is not None else None,
                settings=wandb.Settings(console="off"),
                reinit="create_new",
            )
        except wandb.errors.Error as err:  # e.g. online without an API key, an unreachable server
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise RunStopped(
                f"trainer.logger wandb (trainer.wandb_mode={options.mode}, ran as {self.mode}): {first}"
            ) from None
        self.run.define_metric(STEP_KEY)
        self.run.define_metric("*", step_metric=STEP_KEY)

    def log(self, values: Mapping[str, float], *, step: int) -> None:
        self.run.log({STEP_KEY: step, **values})

    def close(self) -> None:
        """Finish the run and wait until W&B has written (or, online, sent) all of it: ``finish``
        alone returns before the service process has flushed the run's file, and W&B's own exit hook
        may never run (a process killed after a preemption save, multiprocessing). This shuts down
        W&B in the process, other runs of a library caller included."""
        import wandb

        self.run.finish()
        wandb.teardown()
