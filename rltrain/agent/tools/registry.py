"""The tools of a run: the registry of tool classes, the tool config file, and running a turn's calls.

A tool config (``rollout.multi_turn.tool_config_path``, in the style of verl's) is a YAML file::

    tools:
      - class_name: calculator        # a registered name, or a dotted path "pkg.module.Class"
        config: {}                    # keyword arguments of the class (python: memory_mb, cpu_seconds, ...)
        tool_schema:                  # optional: overrides the class's name, description, parameters
          type: function
          function: {name: calculator, description: ..., parameters: {type: object, ...}}

A bad file is a one-line :class:`~rltrain.config.recipe.ConfigError` naming the file and the
entry's key (``tools[1].config.memory_mb``). :meth:`ToolSet.run` answers every call of a turn
with one :class:`ToolResult`, in the order of the calls, and never raises for what a call or a
tool did: an unknown name, arguments failing the tool's JSON schema, calls beyond
``max_parallel_calls``, a tool raising or exceeding ``timeout_s`` all become error results. The
calls within the limit run concurrently.
"""

from __future__ import annotations

import asyncio
import difflib
import inspect
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jsonschema
import jsonschema.exceptions
import yaml

from rltrain.agent.classes import lookup_class
from rltrain.config.recipe import ConfigError

from .base import NOTE_CHARS, Tool, ToolCall, ToolResult, cut_output
from .calculator import CalculatorTool
from .sandbox import PythonSandboxTool

logger = logging.getLogger(__name__)

CLEANUP_GRACE_S = 0.5
"""Time beyond ``timeout_s`` a tool gets before the ToolSet cancels it: tools that enforce the
limit themselves (the sandbox) answer first, with the output they had."""

_REGISTRY: dict[str, type[Tool]] = {}
_ENTRY_KEYS = ("class_name", "config", "tool_schema")
_FUNCTION_KEYS = ("name", "description", "parameters")


def register_tool(name: str, cls: type[Tool]) -> None:
    """Make ``cls`` available to tool configs as ``class_name: <name>``."""
    if not (isinstance(cls, type) and issubclass(cls, Tool)):
        raise TypeError(f"register_tool({name!r}, ...) needs a Tool subclass, got {cls!r}")
    if _REGISTRY.get(name, cls) is not cls:
        raise ValueError(f"tool class name {name!r} is already registered to {_REGISTRY[name]!r}")
    _REGISTRY[name] = cls


def registered_tools() -> list[str]:
    """The registered tool class names, sorted."""
    return sorted(_REGISTRY)


register_tool("calculator", CalculatorTool)
register_tool("python", PythonSandboxTool)


class ToolSet:
    """The tools of a run, by name, with their argument schemas checked once."""

    def __init__(self, tools: Sequence[Tool]) -> None:
        self.tools: dict[str, Tool] = {}
        self._validators: dict[str, jsonschema.protocols.Validator] = {}
        for tool in tools:
            if tool.name in self.tools:
                raise ValueError(f"two tools are named {tool.name!r}")
            problem = schema_problem(tool.parameters)
            if problem:
                raise ValueError(f"tool {tool.name!r}: parameters {problem}")
            self.tools[tool.name] = tool
            self._validators[tool.name] = jsonschema.validators.validator_for(tool.parameters)(
                tool.parameters
            )

    def schemas(self) -> list[dict[str, Any]]:
        """Every tool in the OpenAI function format, in config order (the chat template's ``tools=``)."""
        return [tool.schema() for tool in self.tools.values()]

    async def run(
        self, calls: list[ToolCall], *, max_parallel_calls: int, timeout_s: float, max_output_chars: int
    ) -> list[ToolResult]:
        """One result per call, in order; the first ``max_parallel_calls`` calls run concurrently."""
        return list(
            await asyncio.gather(
                *(
                    self._run_one(call, index, max_parallel_calls, timeout_s, max_output_chars)
                    for index, call in enumerate(calls)
                )
            )
        )

    async def _run_one(
        self, call: ToolCall, index: int, max_parallel_calls: int, timeout_s: float, max_output_chars: int
    ) -> ToolResult:
        start = time.monotonic()
        if index >= max_parallel_calls:
            return ToolResult.failure(
                "too_many_calls",
                f"error: not run: at most {max_parallel_calls} tool call(s) per turn, this was call {index + 1}",
            )
        tool = self.tools.get(call.name)
        if tool is None:
            return ToolResult.failure(
                "unknown_tool", f"error: unknown tool {call.name!r}; the tools are: {', '.join(self.tools)}"
            )
        problem = jsonschema.exceptions.best_match(self._validators[call.name].iter_errors(call.arguments))
        if problem is not None:
            field = ".".join(str(part) for part in problem.absolute_path)
            detail = f"{field}: {problem.message}" if field else problem.message
            return ToolResult.failure("bad_arguments", f"error: bad arguments for {call.name}: {detail}")
        try:
            result = await asyncio.wait_for(
                tool.execute(call.arguments, timeout_s=timeout_s, max_output_chars=max_output_chars),
                timeout_s + CLEANUP_GRACE_S,
            )
        except TimeoutError:
            result = ToolResult.failure("timeout", f"error: {call.name} timed out after {timeout_s:g} s")
        except Exception as err:  # a bug in a tool must cost the model a turn, not the step
            logger.warning("tool %s raised on %r", call.name, call.raw, exc_info=True)
            message = str(err).strip().splitlines()[0] if str(err).strip() else ""
            result = ToolResult.failure(
                "crash",
                f"error: the tool {call.name} crashed: {type(err).__name__}"
                + (f": {message}" if message else ""),
            )
        text, _ = cut_output(result.text, max_output_chars + NOTE_CHARS)
        return ToolResult(
            text=text, ok=result.ok, error_kind=result.error_kind, seconds=time.monotonic() - start
        )


def schema_problem(parameters: Any) -> str | None:
    """What is wrong with a tool's parameters schema (must be a valid JSON schema of an object), or None."""
    if not isinstance(parameters, dict) or parameters.get("type") != "object":
        return 'must be a JSON schema of an object ({"type": "object", "properties": {...}})'
    try:
        jsonschema.validators.validator_for(parameters).check_schema(parameters)
    except jsonschema.exceptions.SchemaError as err:
        return f"is not a valid JSON schema: {err.message}"
    return None


def load_tool_config(path: str | Path) -> ToolSet:
    """The tools a tool config file names, built and checked."""
    where = str(path)
    try:
        raw = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError([f"{where}: no such tool config file"]) from None
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError([f"{where}: bad YAML{at}: {err.problem or err.context}"]) from None
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
        raise ConfigError([f"{where}: unreadable: {' '.join(str(err).split())}"]) from None
    if not isinstance(raw, dict) or set(raw) != {"tools"}:
        raise ConfigError([f"{where}: must be a mapping with the one key 'tools' (a list of tools)"])
    entries = raw["tools"]
    if not isinstance(entries, list) or not entries:
        raise ConfigError([f"{where}: tools must be a non-empty list"])
    tools: list[Tool] = []
    first_index: dict[str, int] = {}
    for index, entry in enumerate(entries):
        key = f"{where}: tools[{index}]"
        tool = _build_tool(entry, key)
        if tool.name in first_index:
            raise ConfigError(
                [f"{key}: tool name {tool.name!r} is already used by tools[{first_index[tool.name]}]"]
            )
        first_index[tool.name] = index
        tools.append(tool)
    return ToolSet(tools)


def _build_tool(entry: Any, key: str) -> Tool:
    if not isinstance(entry, dict):
        raise ConfigError([f"{key}: must be a mapping with class_name, config, tool_schema"])
    _check_keys(entry, _ENTRY_KEYS, key)
    if not isinstance(entry.get("class_name"), str):
        raise ConfigError(
            [f"{key}.class_name: missing (a registered tool or a dotted path pkg.module.Class)"]
        )
    cls = _resolve_class(entry["class_name"], f"{key}.class_name")
    config = entry.get("config") or {}
    if not isinstance(config, dict):
        raise ConfigError([f"{key}.config: must be a mapping of the class's keyword arguments"])
    _check_options(cls, config, f"{key}.config")
    try:
        tool = cls(**config)
    except (TypeError, ValueError) as err:
        raise ConfigError([f"{key}.config: {err}"]) from None
    if entry.get("tool_schema") is not None:
        _apply_schema(tool, entry["tool_schema"], f"{key}.tool_schema")
    problem = schema_problem(tool.parameters)
    if problem:
        raise ConfigError([f"{key}.class_name: the class's parameters {problem}"])
    return tool


def _resolve_class(name: str, key: str) -> type[Tool]:
    try:
        cls = lookup_class(name, _REGISTRY, Tool)
    except ImportError as err:
        module = name.rpartition(".")[0]
        raise ConfigError([f"{key}: cannot import {module!r} for {name!r}: {err}"]) from None
    if cls is None:
        close = difflib.get_close_matches(name, _REGISTRY, n=1, cutoff=0.5)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(
            [
                f"{key}: {name!r} is neither a registered tool ({', '.join(registered_tools())}) "
                f"nor a dotted path to a Tool subclass{hint}"
            ]
        )
    return cls


def _check_options(cls: type[Tool], config: dict[str, Any], key: str) -> None:
    """Unknown keyword arguments of the tool class are named before the class is called."""
    params = inspect.signature(cls).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return
    accepted = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    for option in config:
        if option not in accepted:
            choices = f"options: {', '.join(accepted)}" if accepted else "the class takes no options"
            raise ConfigError([f"{key}.{option}: unknown option of {cls.__name__}; {choices}"])


def _apply_schema(tool: Tool, schema: Any, key: str) -> None:
    """Override the tool's name, description and parameters with a tool_schema entry's."""
    if not isinstance(schema, dict):
        raise ConfigError([f"{key}: must be a mapping {{type: function, function: {{...}}}}"])
    _check_keys(schema, ("type", "function"), key)
    if schema.get("type", "function") != "function":
        raise ConfigError([f"{key}.type: must be 'function', got {schema['type']!r}"])
    function = schema.get("function")
    if not isinstance(function, dict):
        raise ConfigError([f"{key}.function: must be a mapping of name, description, parameters"])
    _check_keys(function, _FUNCTION_KEYS, f"{key}.function")
    if "name" in function:
        if not isinstance(function["name"], str) or not function["name"]:
            raise ConfigError([f"{key}.function.name: must be a non-empty string"])
        tool.name = function["name"]
    if "description" in function:
        if not isinstance(function["description"], str):
            raise ConfigError([f"{key}.function.description: must be a string"])
        tool.description = function["description"]
    if "parameters" in function:
        problem = schema_problem(function["parameters"])
        if problem:
            raise ConfigError([f"{key}.function.parameters: {problem}"])
        tool.parameters = function["parameters"]


def _check_keys(mapping: dict[Any, Any], allowed: tuple[str, ...], key: str) -> None:
    for name in mapping:
        if name not in allowed:
            close = difflib.get_close_matches(str(name), allowed, n=1, cutoff=0.6)
            hint = f"did you mean {close[0]!r}?" if close else f"allowed: {', '.join(allowed)}"
            raise ConfigError([f"{key}.{name}: unknown key; {hint}"])
