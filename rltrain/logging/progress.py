"""A progress bar over training steps with the ETA (tqdm), resumable from a given step.

Contract: ``StepProgress(total_steps, initial_step=k)`` shows ``k/total`` at start;
``update(metrics)`` advances one step and shows the reward mean (and accuracy) of that step
beside the bar; tqdm estimates the remaining time from the steps done in this process only, so a
resumed run's ETA is not skewed by the steps before the restart.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TextIO

from tqdm import tqdm

from rltrain.logging import metrics as mk

_POSTFIX = (("reward", mk.REWARD_MEAN), ("acc", mk.REWARD_ACCURACY))


class StepProgress:
    """tqdm bar counting training steps."""

    def __init__(
        self,
        total_steps: int,
        *,
        initial_step: int = 0,
        disable: bool = False,
        file: TextIO | None = None,
    ) -> None:
        if not 0 <= initial_step <= total_steps:
            raise ValueError(f"initial_step must lie in [0, total_steps={total_steps}], got {initial_step}")
        self.bar = tqdm(
            total=total_steps,
            initial=initial_step,
            desc="train",
            unit="step",
            dynamic_ncols=True,
            disable=disable,
            file=file,
        )

    @property
    def step(self) -> int:
        """Steps completed, counting those before a resume."""
        return int(self.bar.n)

    def update(self, metrics: Mapping[str, float] | None = None) -> None:
        """Advance one step; show the step's reward beside the bar."""
        if metrics:
            postfix = {label: f"{metrics[key]:.3f}" for label, key in _POSTFIX if key in metrics}
            self.bar.set_postfix(postfix, refresh=False)
        self.bar.update(1)

    def rewind(self, step: int) -> None:
        """Show ``step`` steps done again (a run that recovered resumes from an earlier step)."""
        self.bar.n = step
        self.bar.refresh()

    def close(self) -> None:
        self.bar.close()

    def __enter__(self) -> StepProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
