"""Interactions: an environment that answers each assistant turn (verl's ``interaction_config_path``).

An :class:`Interaction` sees every assistant turn that calls no tool and answers with the next
user message, a reward for the turn, or both; a turn answered with no message ends the trajectory.
One interaction serves a run, named in a YAML file::

    interaction:
      - name: feedback
        class_name: feedback          # a registered name or a dotted path "pkg.module.Class"
        config: {max_score_turns: 2}  # the class's keyword arguments

Per-turn rewards land on the last token of the turn they reward (``Trajectory.turn_rewards``), added
to the outcome score the reward function gives the whole response at its last model token.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from rltrain.agent.classes import lookup_class
from rltrain.config.recipe import ConfigError


@dataclass(frozen=True)
class InteractionTurn:
    message: str | None
    """The next user message; None ends the trajectory."""

    reward: float | None = None
    """Reward of the assistant turn just answered (None: none)."""


class Interaction(ABC):
    """Answers assistant turns of one trajectory; ``start`` makes the per-trajectory state."""

    name: str = "interaction"

    @abstractmethod
    async def start(self, *, ground_truth: str, data_source: str) -> Any:
        """State of a new trajectory."""

    @abstractmethod
    async def respond(self, state: Any, assistant_text: str, *, turn: int) -> InteractionTurn:
        """Answer assistant turn ``turn`` (1-based) whose decoded text is ``assistant_text``."""


_REGISTRY: dict[str, type[Interaction]] = {}


def register_interaction(name: str, cls: type[Interaction]) -> None:
    _REGISTRY[name] = cls


def registered_interactions() -> list[str]:
    return sorted(_REGISTRY)


class InteractionConfigError(ConfigError):
    """A bad interaction file (the message names the file and the key)."""

    def __init__(self, message: str) -> None:
        super().__init__([message])
        self.message = message

    def __str__(self) -> str:
        return self.message


def load_interaction(path: str | Path) -> Interaction:
    """The interaction the YAML file at ``path`` names (exactly one entry)."""
    from rltrain.agent.interactions import feedback  # noqa: F401  (registers the built-in)

    where = str(path)
    try:
        raw = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InteractionConfigError(f"{where}: no such interaction file") from None
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
        raise InteractionConfigError(f"{where}: unreadable: {str(err).splitlines()[0]}") from None
    entries = raw.get("interaction") if isinstance(raw, dict) else None
    if not isinstance(entries, list) or len(entries) != 1 or not isinstance(entries[0], dict):
        raise InteractionConfigError(f"{where}: 'interaction' must be a list of exactly one entry")
    entry = entries[0]
    class_name, config = entry.get("class_name"), entry.get("config") or {}
    if not isinstance(class_name, str):
        raise InteractionConfigError(f"{where}: interaction[0].class_name is missing")
    if not isinstance(config, dict):
        raise InteractionConfigError(f"{where}: interaction[0].config must be a mapping")
    cls = _resolve(class_name, where)
    try:
        interaction = cls(**config)
    except TypeError as err:
        raise InteractionConfigError(f"{where}: interaction[0].config: {err}") from None
    interaction.name = str(entry.get("name") or class_name)
    return interaction


def _resolve(class_name: str, where: str) -> type[Interaction]:
    try:
        cls = lookup_class(class_name, _REGISTRY, Interaction)
    except ImportError:
        cls = None
    if cls is None:
        raise InteractionConfigError(
            f"{where}: interaction[0].class_name {class_name!r} is neither a registered interaction "
            f"({', '.join(registered_interactions())}) nor an importable Interaction subclass"
        )
    return cls
