"""Errors that stop a run with a message that says everything: the command line prints it as one line,
without a traceback, and exits 1.

Contract: a :class:`RunStopped` is raised for a condition of the run (not a bug of ours) whose message
names the culprit (role, rank, parameter, address) and, where one exists, what to do instead. Its
constructor takes the message alone, so that a worker's error can be raised again in the driver with
the role and rank in front (:mod:`rltrain.orchestrator.worker_group`). Imports nothing.
"""

from __future__ import annotations


class RunStopped(RuntimeError):
    """The run cannot go on; the one-line message names why and where."""


class DivergenceError(RunStopped):
    """Training diverged: a role kept skipping optimizer steps for non-finite values, or its
    parameters are no longer finite (or blew past ``trainer.max_param_abs``) after an update."""


class NonFiniteWeightsError(RunStopped):
    """The weight sync refused weights holding NaN or infinite values (the engines keep theirs)."""


class WeightSyncMismatchError(RunStopped):
    """After a weight sync an engine worker's weights differ from what the trainer sent
    (``rollout.weight_sync.verify_checksums``): the message names the HF tensor, the engine rank
    and the trainer rank that sent it."""
