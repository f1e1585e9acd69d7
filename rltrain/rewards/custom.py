"""A reward function loaded from a Python file (verl's ``custom_reward_function``), scoring every row.

Contract: ``reward.custom_reward_function.path`` names a ``.py`` file and ``.name`` a function in
it (default ``compute_score``); it is called for every response, whatever its data_source, as verl
calls it: ``fn(data_source=..., solution_str=..., ground_truth=..., extra_info=...,
**reward_kwargs)``, keywords only. Its answer is read by
:func:`~rltrain.rewards.external.result_from_answer` (a number, a bool or a dict with a
``score``). The file is loaded when the manager is built, so a missing file, a syntax error or
an error while importing it, a missing function and a signature that cannot take those keywords
fail before the first rollout, each in one line naming the file and the key
(:class:`RewardFunctionError`).

The loaded module is kept in ``sys.modules`` under a name made from the file's absolute path and
modification time, so it runs once per process (and again after the file is edited). A :class:`CustomReward` travels to other processes (Ray scoring tasks) as
its path, name and keywords: it loads the file again there instead of pickling the function, so
the file must exist at the same absolute path on every machine that scores.
"""

from __future__ import annotations

import hashlib
import inspect
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from rltrain.config.recipe import ConfigError
from rltrain.rewards.external import ScoreRequest, result_from_answer
from rltrain.rewards.registry import RewardResult

KEY = "reward.custom_reward_function"
VERL_ARGUMENTS = ("data_source", "solution_str", "ground_truth", "extra_info")
"""The keyword arguments verl passes a custom reward function."""


class RewardFunctionError(ConfigError):
    """The custom reward function cannot be loaded or called (one line naming the file and the key)."""

    def __init__(self, message: str) -> None:
        super().__init__([message])

    def __reduce__(self) -> tuple[type, tuple[str]]:  # from a Ray task: the message, not the wrapped one
        return type(self), (self.problems[0],)


def _module_name(path: Path) -> str:
    """A name for the module of ``path`` as it is now (an edited file gets a new one)."""
    stat = path.stat()
    key = f"{path}:{stat.st_mtime_ns}:{stat.st_size}"
    return "rltrain_custom_reward_" + hashlib.sha1(key.encode()).hexdigest()[:16]


def _load_module(path: Path, given: str) -> ModuleType:
    """The module of ``path``, executed once per process (again after the file changed)."""
    where = f"{KEY}.path={given!r}"
    if not path.is_file():
        raise RewardFunctionError(f"{where}: no such file ({path})")
    name = _module_name(path)
    if name in sys.modules:
        return sys.modules[name]
    module = ModuleType(name)
    module.__file__ = str(path)
    sys.modules[name] = module  # as an import would: dataclasses and pickling in the file look it up
    try:
        exec(compile(path.read_bytes(), str(path), "exec"), module.__dict__)  # no .pyc beside the file
    except SyntaxError as err:
        del sys.modules[name]
        raise RewardFunctionError(f"{where}: syntax error at line {err.lineno}: {err.msg}") from None
    except Exception as err:
        del sys.modules[name]
        raise RewardFunctionError(f"{where}: importing it raised {type(err).__name__}: {err}") from err
    return module


def load_reward_function(
    path: str, name: str, reward_kwargs: Mapping[str, Any], *, given: str | None = None
) -> Callable[..., Any]:
    """The function ``name`` of the file ``path``, checked to take verl's keywords plus
    ``reward_kwargs``; errors name the path as the config ``given`` it (default ``path``)."""
    given = path if given is None else given
    resolved = Path(path).expanduser().resolve()
    module = _load_module(resolved, given)
    where = f"{KEY}.path={given!r}"
    fn = getattr(module, name, None)
    if fn is None:
        defined = sorted(
            k for k, v in vars(module).items() if inspect.isfunction(v) and not k.startswith("_")
        )
        raise RewardFunctionError(
            f"{where}: no function {name!r} ({KEY}.name) in {resolved}; its functions: {defined}"
        )
    if not callable(fn):
        raise RewardFunctionError(
            f"{where}: {name!r} ({KEY}.name) is not callable (a value of type {type(fn).__name__})"
        )
    if inspect.iscoroutinefunction(fn):
        raise RewardFunctionError(
            f"{where}: {name!r} is a coroutine function; rltrain calls a custom reward synchronously"
        )
    clash = sorted(set(reward_kwargs) & set(VERL_ARGUMENTS))
    if clash:
        raise RewardFunctionError(f"{KEY}.reward_kwargs may not set {clash}: the reward manager passes them")
    try:
        inspect.signature(fn).bind(**{a: None for a in VERL_ARGUMENTS}, **reward_kwargs)
    except TypeError as err:
        raise RewardFunctionError(
            f"{where}: {name}() cannot be called as {name}(data_source=, solution_str=, ground_truth=, "
            f"extra_info=, plus {KEY}.reward_kwargs {sorted(reward_kwargs)}): {err}"
        ) from None
    return fn


class CustomReward:
    """Scores every row with the function ``name`` of the file ``path``."""

    def __init__(
        self,
        path: str,
        *,
        name: str = "compute_score",
        reward_kwargs: Mapping[str, Any] | None = None,
        correct_score: float = 1.0,
    ) -> None:
        """Loads the file now (errors in one line); ``correct_score``: a plain number at least this
        counts as correct."""
        self.given = path
        self.path = str(Path(path).expanduser().resolve())  # the same file from a task's other cwd
        self.name = name
        self.reward_kwargs = dict(reward_kwargs or {})
        self.correct_score = correct_score
        self.origin = f"{KEY}.path={path!r}: {name}()"
        self._fn: Callable[..., Any] | None = self._load()

    def _load(self) -> Callable[..., Any]:
        return load_reward_function(self.path, self.name, self.reward_kwargs, given=self.given)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_fn": None}  # loaded again by path where it lands

    def score_requests(self, requests: Sequence[ScoreRequest]) -> list[RewardResult]:
        if self._fn is None:
            self._fn = self._load()
        fn = self._fn
        return [
            result_from_answer(
                fn(
                    data_source=r.data_source,
                    solution_str=r.solution_str,
                    ground_truth=r.ground_truth,
                    extra_info=dict(r.extra_info),
                    **self.reward_kwargs,
                ),
                correct_score=self.correct_score,
                origin=self.origin,
                request=r,
            )
            for r in requests
        ]
