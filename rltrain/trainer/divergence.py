"""The driver's divergence guard of one trainable role: divergence stops the run, it is never silent.

Contract: :meth:`DivergenceGuard.check` takes the metrics of a role's optimizer steps in order (what
the workers' ``update_actor``/``update_critic`` return: ``<role>/skipped_steps`` 1.0 for a step
skipped for a non-finite gradient, ``<role>/param_max_abs`` the largest parameter magnitude after
it, the loss metrics and ``<role>/grad_norm``) and raises :class:`~rltrain.errors.DivergenceError`
in one line, naming the role and the culprit, when

- ``trainer.max_consecutive_skipped_steps`` steps in a row were skipped (the streak carries over
  from one update to the next; a step that is not skipped ends it): the message names the first
  non-finite value of the streak's first step (the loss before the gradient norm: the loss comes
  first in the computation);
- a parameter's magnitude exceeds ``trainer.max_param_abs`` after a step (weights blown up by a
  huge learning rate stay finite, then make every later step non-finite).

The workers stop the run themselves when a parameter is not finite after a step
(:func:`rltrain.megatron.train_step.train_step`). The driver calls ``check`` right after the update,
so a diverged state is never saved: checkpoints come after the update of their step.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from rltrain.config.trainer import TrainerConfig
from rltrain.errors import DivergenceError
from rltrain.logging import metrics as mk


@dataclass
class DivergenceGuard:
    role: str
    """The metric prefix of the role (``actor`` or ``critic``)."""

    max_consecutive_skipped: int
    """``trainer.max_consecutive_skipped_steps``."""

    max_param_abs: float | None
    """``trainer.max_param_abs`` (None: no bound)."""

    skipped_in_a_row: int = 0
    """Optimizer steps skipped since the last one that was not."""

    first_non_finite: str = ""
    """The first non-finite value of the current streak's first step, as ``key=value``."""

    @classmethod
    def from_config(cls, role: str, trainer: TrainerConfig) -> DivergenceGuard:
        return cls(role, trainer.max_consecutive_skipped_steps, trainer.max_param_abs)

    def check(self, steps: Sequence[Mapping[str, float]]) -> None:
        """Account for one update's optimizer steps; raises :class:`DivergenceError` on divergence."""
        for metrics in steps:
            if metrics[f"{self.role}/{mk.SKIPPED_STEPS}"]:
                if self.skipped_in_a_row == 0:
                    self.first_non_finite = self._first_non_finite(metrics)
                self.skipped_in_a_row += 1
                if self.skipped_in_a_row >= self.max_consecutive_skipped:
                    raise DivergenceError(
                        f"{self.role} diverged: {self.skipped_in_a_row} optimizer steps in a row skipped "
                        f"for non-finite values (trainer.max_consecutive_skipped_steps="
                        f"{self.max_consecutive_skipped}); the first had {self.first_non_finite}"
                    )
            else:
                self.skipped_in_a_row = 0
            largest = metrics[f"{self.role}/{mk.PARAM_MAX_ABS}"]
            if self.max_param_abs is not None and largest > self.max_param_abs:
                raise DivergenceError(
                    f"{self.role} diverged: a parameter reached magnitude {largest:.4g} after an optimizer "
                    f"step (lr {metrics[f'{self.role}/{mk.LR}']:g}), above trainer.max_param_abs="
                    f"{self.max_param_abs:g}"
                )

    def _first_non_finite(self, metrics: Mapping[str, float]) -> str:
        ignored = {f"{self.role}/{name}" for name in (mk.SKIPPED_STEPS, mk.LR, mk.PARAM_MAX_ABS)}
        grad_norm = f"{self.role}/{mk.GRAD_NORM}"
        losses = [k for k in metrics if k not in ignored and k != grad_norm]
        for key in [*losses, grad_norm]:
            if not math.isfinite(metrics[key]):
                return f"{key}={metrics[key]}"
        return f"{grad_norm}={metrics[grad_norm]} with non-finite gradient entries"
