"""Algorithms as objects: what each RL algorithm adds to the step loop (:mod:`.base`); one file per
algorithm that needs more than KL-regularized PPO (:mod:`.remax`), DAPO's dynamic sampling
(:mod:`.dapo`). Importing the package registers them."""

from rltrain.trainer.algorithms import remax
from rltrain.trainer.algorithms.base import ALGORITHMS, Algorithm, Needs, build_algorithm, register_algorithm

__all__ = ["ALGORITHMS", "Algorithm", "Needs", "build_algorithm", "register_algorithm", "remax"]
