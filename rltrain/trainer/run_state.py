"""The checkpoint side of the driver, mixed into :class:`~rltrain.trainer.driver.PPOTrainer`: saving
every role and the driver's state (step, data position, KL controller, the pipeline's untrained
batches) as one run checkpoint, and resuming from the newest one that verifies and loads
(:mod:`rltrain.trainer.checkpoints`). The data position is restored before any role loads, so
that a run whose data order changed is refused at once; another batch size resumes at the same
prompt (:func:`resume_data_order`).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rltrain.data.loader import LoaderStateMismatch, PromptLoader
from rltrain.trainer.checkpoints import STATE_FILE, CheckpointError, CheckpointLoadError
from rltrain.trainer.pipeline import PIPELINE_FILE, read_state, write_state
from rltrain.trainer.recovery import WorkerError, WorkerLost

if TYPE_CHECKING:
    from rltrain.trainer.driver import PPOTrainer

log = logging.getLogger(__name__)


class CheckpointedRun:
    """``save``, ``resume`` and ``load_checkpoint`` of a :class:`~rltrain.trainer.driver.PPOTrainer`
    (its roles, data, KL controller, rollout source and ``RunCheckpoints``)."""

    def save(self: PPOTrainer, step: int) -> None:
        """Checkpoint every role and the driver's state as ``step_<step>``; a failed save raises
        :class:`~rltrain.trainer.checkpoints.CheckpointError` and leaves ``latest`` as it was."""

        def write_roles(path: Path) -> None:
            self.roles.policy.save(str(path), step)
            if self.roles.critic is not None:
                self.roles.critic.save(str(path), step)
            write_state(self.source, path)  # asynchronous pipelines: the batches not trained yet

        state = {"step": step, "data": self.data.train.state_dict(), "kl_ctrl": self.kl_ctrl.state_dict()}
        self.checkpoints.save(step, write_roles=write_roles, state=state)

    def resume(self: PPOTrainer, *, recovering: bool = False) -> int:
        """The step to continue after: 0 for a fresh start, else that of the newest checkpoint that
        verifies and loads (:meth:`RunCheckpoints.resume` falls back past the others, one line each).
        ``recovering`` (after a restart of the workers): the run's newest such checkpoint, else the
        one it started from (``resume_from_path``), else step 0."""
        trainer = self.config.trainer
        explicit = trainer.resume_from_path if trainer.resume_mode == "resume_path" else None
        if recovering:
            step = self.checkpoints.resume(self.load_checkpoint)
            if step is None and explicit is not None:
                step = self.checkpoints.resume(self.load_checkpoint, explicit=explicit)
            return step or 0
        if trainer.resume_mode == "disable":
            self.checkpoints.start_fresh(discard_existing=trainer.checkpoint.discard_existing)
            return 0
        step = self.checkpoints.resume(self.load_checkpoint, explicit=explicit)
        return 0 if step is None else step

    def load_checkpoint(self: PPOTrainer, path: Path) -> int:
        """Load the checkpoint at ``path`` into every role and the driver; returns its step.

        A role that fails to load it raises :class:`CheckpointLoadError` (one line, naming role, rank
        and cause); a later load of another checkpoint overwrites whatever was loaded in part."""
        state = self.checkpoints.read_state(path)
        resume_data_order(self.data.train, state["data"], checkpoint=path)  # refused before any role loads
        for role in (self.roles.policy, self.roles.critic):
            if role is None:
                continue
            try:
                loaded = role.load(str(path))
            except WorkerLost:  # the worker, not the checkpoint: a restart's business
                raise
            except WorkerError as err:
                raise CheckpointLoadError(str(err).splitlines()[0]) from err
            if loaded != state["step"]:
                raise CheckpointLoadError(
                    f"a role checkpoint holds step {loaded}, {STATE_FILE} {state['step']}"
                )
        self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        read_state(self.source, path)
        log.info("resumed from %s (step %d)", path, state["step"])
        return int(state["step"])


def resume_data_order(loader: PromptLoader, saved: dict[str, Any], *, checkpoint: Path) -> None:
    """Put ``loader`` where the checkpoint's data order stopped. Another batch size goes on from the same
    prompt (said in the log); another order, or another batch size with untrained pipeline batches of
    the old one in the checkpoint, raises :class:`CheckpointError` (one line naming the key)."""
    pipeline = checkpoint / PIPELINE_FILE
    resized = saved["batch_size"] != loader.batch_size
    if resized and pipeline.exists() and json.loads(pipeline.read_text())["batches"]:
        raise CheckpointError(
            f"cannot resume from {checkpoint}: it holds rollouts of {saved['batch_size']} prompts not "
            f"trained yet ({PIPELINE_FILE}) and this run draws {loader.batch_size} "
            "(data.train_batch_size / data.gen_batch_size changed): resume with the saved batch size"
        )
    try:
        loader.load_state_dict(saved)
    except LoaderStateMismatch as err:
        raise CheckpointError(
            f"cannot resume from {checkpoint}: {err}; resume with the saved setting or start a new run "
            "(trainer.experiment_name=...)"
        ) from None
    if resized:
        log.warning(
            "the data batch size was %d when %s was saved and is %d now: resuming at prompt %d of epoch %d's "
            "order in batches of %d",
            saved["batch_size"],
            checkpoint.name,
            loader.batch_size,
            loader.offset,
            loader.epoch,
            loader.batch_size,
        )
