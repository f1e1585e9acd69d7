"""Tools of the agent loop: the call format, the registry and config file, the built-in tools.

See :mod:`.base` (what a tool, a call and a result are), :mod:`.parser` (tool-call formats),
:mod:`.registry` (the tools of a run and their config file), :mod:`.calculator` and
:mod:`.sandbox` (the built-in ``calculator`` and ``python`` tools). Pure Python: no vllm, megatron
or ray.
"""

from .base import ERROR_KINDS, ParsedTurn, Tool, ToolCall, ToolResult
from .calculator import CalculatorTool
from .parser import get_parser, parse_hermes
from .registry import ToolSet, load_tool_config, register_tool, registered_tools
from .sandbox import PythonSandboxTool

__all__ = [
    "ERROR_KINDS",
    "CalculatorTool",
    "ParsedTurn",
    "PythonSandboxTool",
    "Tool",
    "ToolCall",
    "ToolResult",
    "ToolSet",
    "get_parser",
    "load_tool_config",
    "parse_hermes",
    "register_tool",
    "registered_tools",
]
