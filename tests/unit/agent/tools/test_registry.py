"""ToolSet.run (every failure an exact error result, in call order) and the tool config file."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from rltrain.agent.tools import (
    CalculatorTool,
    PythonSandboxTool,
    Tool,
    ToolCall,
    ToolResult,
    ToolSet,
    load_tool_config,
    register_tool,
    registered_tools,
)
from rltrain.agent.tools.registry import CLEANUP_GRACE_S
from rltrain.config.recipe import ConfigError


class Echo(Tool):
    """Answers its text after ``delay_s``; raises when told to."""

    name = "echo"
    description = "Repeat a text."
    parameters = {  # noqa: RUF012
        "type": "object",
        "properties": {
            "text": {"type": "string"},
            "delay_s": {"type": "number"},
            "fail": {"type": "boolean"},
        },
        "required": ["text"],
        "additionalProperties": False,
    }

    def __init__(self, *, prefix: str = "") -> None:
        self.prefix = prefix

    async def execute(
        self, arguments: dict[str, Any], *, timeout_s: float, max_output_chars: int
    ) -> ToolResult:
        await asyncio.sleep(arguments.get("delay_s", 0.0))
        if arguments.get("fail"):
            raise RuntimeError("the echo broke\nsecond line")
        return ToolResult(text=self.prefix + arguments["text"], ok=True, error_kind=None, seconds=0.0)


def call(name: str, **arguments: Any) -> ToolCall:
    return ToolCall(name=name, arguments=arguments, raw=f"<{name}>")


def run(
    tools: ToolSet, calls: list[ToolCall], *, max_parallel_calls: int = 8, timeout_s: float = 5.0
) -> list[ToolResult]:
    return asyncio.run(
        tools.run(calls, max_parallel_calls=max_parallel_calls, timeout_s=timeout_s, max_output_chars=100)
    )


def outcomes(results: list[ToolResult]) -> list[tuple[str, bool, str | None]]:
    return [(r.text, r.ok, r.error_kind) for r in results]


TOOLS = ToolSet([CalculatorTool(), Echo()])


def test_results_in_call_order_with_each_failure_named() -> None:
    results = run(
        TOOLS,
        [
            call("echo", text="slow", delay_s=0.3),
            call("calculator", expression="4821+3977"),
            call("search", query="x"),
            call("calculator"),
            call("calculator", expression=5),
            call("echo", text="hi", colour="red"),
            call("echo", text="boom", fail=True),
        ],
    )
    assert outcomes(results) == [
        ("slow", True, None),
        ("8798", True, None),
        ("error: unknown tool 'search'; the tools are: calculator, echo", False, "unknown_tool"),
        ("error: bad arguments for calculator: 'expression' is a required property", False, "bad_arguments"),
        ("error: bad arguments for calculator: expression: 5 is not of type 'string'", False, "bad_arguments"),
        ("error: bad arguments for echo: Additional properties are not allowed ('colour' was unexpected)", False, "bad_arguments"),
        ("error: the tool echo crashed: RuntimeError: the echo broke", False, "crash"),
    ]  # fmt: skip
    assert results[0].seconds >= 0.3


def test_calls_run_concurrently() -> None:
    start = time.monotonic()
    results = run(TOOLS, [call("echo", text=str(i), delay_s=0.5) for i in range(4)])
    assert [r.text for r in results] == ["0", "1", "2", "3"]
    assert time.monotonic() - start < 1.5  # one after the other would take 2 s


def test_calls_beyond_max_parallel_calls_are_not_run() -> None:
    results = run(
        TOOLS,
        [call("echo", text="a"), call("echo", text="b"), call("calculator", expression="1")],
        max_parallel_calls=2,
    )
    assert outcomes(results) == [
        ("a", True, None),
        ("b", True, None),
        ("error: not run: at most 2 tool call(s) per turn, this was call 3", False, "too_many_calls"),
    ]  # fmt: skip


def test_a_tool_past_the_timeout_is_cancelled() -> None:
    start = time.monotonic()
    results = run(TOOLS, [call("echo", text="late", delay_s=30), call("echo", text="on time")], timeout_s=0.2)
    elapsed = time.monotonic() - start
    assert outcomes(results) == [
        ("error: echo timed out after 0.2 s", False, "timeout"),
        ("on time", True, None),
    ]
    assert 0.2 + CLEANUP_GRACE_S <= results[0].seconds < elapsed < 0.2 + CLEANUP_GRACE_S + 1.0


def test_a_result_longer_than_the_limit_is_cut() -> None:
    (result,) = run(TOOLS, [call("echo", text="x" * 1000)])
    assert result.text == "x" * 300 + "\n[output cut at 300 characters]"  # 100 chars + the 200 of notes


def test_toolset_refuses_duplicate_names_and_bad_schemas() -> None:
    with pytest.raises(ValueError, match=r"^two tools are named 'echo'$"):
        ToolSet([Echo(), Echo()])
    bad = Echo()
    bad.parameters = {"type": "string"}
    with pytest.raises(ValueError, match=r"^tool 'echo': parameters must be a JSON schema of an object"):
        ToolSet([bad])


def test_registry() -> None:
    assert registered_tools() == ["calculator", "python"]
    register_tool("calculator", CalculatorTool)  # the same class again is fine
    with pytest.raises(ValueError, match=r"^tool class name 'calculator' is already registered to"):
        register_tool("calculator", Echo)
    with pytest.raises(
        TypeError, match=r"^register_tool\('x', \.\.\.\) needs a Tool subclass, got <class 'int'>$"
    ):
        register_tool("x", int)  # type: ignore[arg-type]


GOOD = """\
tools:
  - class_name: python
    config: {memory_mb: 256, cpu_seconds: 3}
  - class_name: rltrain.agent.tools.calculator.CalculatorTool
    tool_schema:
      type: function
      function:
        name: add
        description: Add numbers.
        parameters: {type: object, properties: {expression: {type: string}}, required: [expression]}
  - class_name: calculator
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "tools.yaml"
    path.write_text(text)
    return path


def test_good_config_gives_the_schemas_and_the_configured_tools(tmp_path: Path) -> None:
    tools = load_tool_config(write(tmp_path, GOOD))
    assert tools.schemas() == [
        {
            "type": "function",
            "function": {
                "name": "python",
                "description": PythonSandboxTool.description,
                "parameters": {
                    "type": "object",
                    "properties": {
                        "code": {"type": "string", "description": "The program; print what you want to see."}
                    },
                    "required": ["code"],
                },
            },
        },
        {
            "type": "function",
            "function": {
                "name": "add",
                "description": "Add numbers.",
                "parameters": {
                    "type": "object",
                    "properties": {"expression": {"type": "string"}},
                    "required": ["expression"],
                },
            },
        },
        CalculatorTool().schema(),
    ]
    python = tools.tools["python"]
    assert isinstance(python, PythonSandboxTool) and (python.limits.memory_mb, python.limits.cpu_seconds) == (
        256,
        3,
    )
    assert (
        isinstance(tools.tools["add"], CalculatorTool) and CalculatorTool.name == "calculator"
    )  # instance only
    assert outcomes(run(tools, [call("add", expression="1+2"), call("add", expression="1", extra=1)])) == [
        ("3", True, None),
        ("1", True, None),  # the overriding schema allows additional properties
    ]


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("tools: [", "bad YAML at line 1, column 9: expected the node content, but found '<stream end>'"),
        ("- calculator\n", "must be a mapping with the one key 'tools' (a list of tools)"),
        ("tools: []\n", "tools must be a non-empty list"),
        ("tools:\n  - calculator\n", "tools[0]: must be a mapping with class_name, config, tool_schema"),
        ("tools:\n  - config: {}\n", "tools[0].class_name: missing (a registered tool or a dotted path pkg.module.Class)"),
        ("tools:\n  - class_name: calculater\n", "tools[0].class_name: 'calculater' is neither a registered tool (calculator, python) nor a dotted path to a Tool subclass; did you mean 'calculator'?"),
        ("tools:\n  - class_name: os.path\n", "tools[0].class_name: 'os.path' is neither a registered tool (calculator, python) nor a dotted path to a Tool subclass"),
        ("tools:\n  - class_name: nowhere.Tool\n", "tools[0].class_name: cannot import 'nowhere' for 'nowhere.Tool': No module named 'nowhere'"),
        ("tools:\n  - class_name: calculator\n    confg: {}\n", "tools[0].confg: unknown key; did you mean 'config'?"),
        ("tools:\n  - class_name: python\n    config: {memory: 1}\n", "tools[0].config.memory: unknown option of PythonSandboxTool; options: memory_mb, cpu_seconds, file_size_mb, max_processes, namespaces"),
        ("tools:\n  - class_name: python\n    config: {memory_mb: 10}\n", "tools[0].config: memory_mb must be an integer of at least 64, got 10"),
        ("tools:\n  - class_name: calculator\n    config: {x: 1}\n", "tools[0].config.x: unknown option of CalculatorTool; the class takes no options"),
        ("tools:\n  - class_name: calculator\n    config: [1]\n", "tools[0].config: must be a mapping of the class's keyword arguments"),
        ("tools:\n  - class_name: calculator\n  - class_name: calculator\n", "tools[1]: tool name 'calculator' is already used by tools[0]"),
        ("tools:\n  - class_name: calculator\n    tool_schema: {type: tool}\n", "tools[0].tool_schema.type: must be 'function', got 'tool'"),
        ("tools:\n  - class_name: calculator\n    tool_schema: {function: {parameters: {type: array}}}\n", 'tools[0].tool_schema.function.parameters: must be a JSON schema of an object ({"type": "object", "properties": {...}})'),
        ("tools:\n  - class_name: calculator\n    tool_schema: {function: {parameters: {type: object, required: 3}}}\n", "tools[0].tool_schema.function.parameters: is not a valid JSON schema: 3 is not of type 'array'"),
        ("tools:\n  - class_name: calculator\n    tool_schema: {function: {name: ''}}\n", "tools[0].tool_schema.function.name: must be a non-empty string"),
        ("tools:\n  - class_name: calculator\n    tool_schema: {function: {nam: x}}\n", "tools[0].tool_schema.function.nam: unknown key; did you mean 'name'?"),
        ("tools:\n  - class_name: calculator\n    tool_schema: {function: 1}\n", "tools[0].tool_schema.function: must be a mapping of name, description, parameters"),
    ],
)  # fmt: skip
def test_bad_config_is_one_line_naming_file_and_key(tmp_path: Path, text: str, problem: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as caught:
        load_tool_config(path)
    assert str(caught.value) == f"invalid configuration: {path}: {problem}"


def test_missing_config_file(tmp_path: Path) -> None:
    with pytest.raises(
        ConfigError, match=r"^invalid configuration: \S+/none\.yaml: no such tool config file$"
    ):
        load_tool_config(tmp_path / "none.yaml")


def test_unreadable_config_file(tmp_path: Path) -> None:
    path = tmp_path / "tools.yaml"
    path.write_bytes(b"tools: \xff\n")
    with pytest.raises(ConfigError) as caught:
        load_tool_config(path)
    assert str(caught.value) == (
        f"invalid configuration: {path}: unreadable: 'utf-8' codec can't decode byte 0xff in position 7: invalid start byte"
    )
