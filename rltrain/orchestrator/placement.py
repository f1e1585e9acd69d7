"""Where the rollout engines sit, computed once from the config: :func:`rollout_placement`.

Pure (no Ray): the Ray entry reserves its placement-group bundles from it, the policy workers read
which ranks host an engine and the engine's tensor-parallel size, the torchrun mode builds its role
handles from it. The layout:

- the trainer has one bundle per device (``cluster.nnodes × cluster.n_gpus_per_node``); the policy
  worker (actor + reference, + a colocated engine) and the critic worker of rank i share bundle i;
- ``rollout.mode: colocated``: an engine of ``rollout.tensor_model_parallel_size`` (TP) workers on
  every TP-th trainer rank (ranks 0, TP, 2·TP, ...), sharing the devices of ranks r .. r+TP-1;
- ``rollout.mode: separate``: ``rollout.num_devices // TP`` engines on devices of their own, one
  bundle each (holding its TP devices) after the trainer's, weights broadcast from actor rank 0.

On a CPU-only cluster every bundle is one CPU (an engine's TP workers share it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rltrain.config import RLConfig


@dataclass(frozen=True)
class Bundle:
    """The resources one placement-group bundle reserves."""

    num_cpus: int
    num_gpus: int
    """0 on a CPU-only cluster (the bundle then names no GPU at all)."""

    def resources(self) -> dict[str, int]:
        """Ray's bundle dict: ``{"CPU": c, "GPU": g}``, or ``{"CPU": c}`` without GPUs."""
        if self.num_gpus:
            return {"CPU": self.num_cpus, "GPU": self.num_gpus}
        return {"CPU": self.num_cpus}


@dataclass(frozen=True)
class RolloutPlacement:
    """The rollout layout of a run (see the module docstring)."""

    mode: Literal["colocated", "separate"]
    """``rollout.mode``."""
    engine_tp: int
    """Tensor-parallel size of each engine (``rollout.tensor_model_parallel_size``)."""
    engine_ranks: tuple[int, ...]
    """Trainer ranks that host a colocated engine, ascending; empty when ``separate``."""
    num_engines: int
    """Engines of the run: ``len(engine_ranks)`` colocated, ``rollout.num_devices // engine_tp``
    separate."""
    trainer_bundles: tuple[Bundle, ...]
    """One per trainer device, in rank order (bundle i hosts rank i of every trainer role)."""
    engine_bundles: tuple[Bundle, ...]
    """One per separate engine (its TP devices), after the trainer's; empty when colocated."""

    @property
    def separate(self) -> bool:
        return self.mode == "separate"

    @property
    def bundles(self) -> tuple[Bundle, ...]:
        """Every bundle of the run's placement group: the trainer's, then the engines'."""
        return self.trainer_bundles + self.engine_bundles

    @property
    def first_engine_bundle(self) -> int:
        """Index of the first separate engine's bundle in :attr:`bundles`."""
        return len(self.trainer_bundles)


def rollout_placement(config: RLConfig, *, gpu: bool) -> RolloutPlacement:
    """The rollout layout of ``config`` (already validated: TP divides what it must); ``gpu``: the
    cluster's devices are GPUs (bundles reserve them)."""
    rollout = config.rollout
    world, tp = config.cluster.world_size(), rollout.tensor_model_parallel_size
    separate = rollout.mode == "separate"
    engine_ranks = () if separate else tuple(range(0, world, tp))
    num_engines = rollout.num_devices // tp if separate else len(engine_ranks)
    return RolloutPlacement(
        mode=rollout.mode,
        engine_tp=tp,
        engine_ranks=engine_ranks,
        num_engines=num_engines,
        trainer_bundles=(Bundle(num_cpus=1, num_gpus=1 if gpu else 0),) * world,
        engine_bundles=(Bundle(num_cpus=1, num_gpus=tp if gpu else 0),) * (num_engines if separate else 0),
    )
