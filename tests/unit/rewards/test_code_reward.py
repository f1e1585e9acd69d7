"""The code reward: a response's program runs against stdin/stdout tests in the sandbox
(rltrain.sandbox); a correct one passes, a wrong one fails, an infinite loop and a memory bomb fail
within the limits of reward.sandbox and leave this process unharmed; ground truths it cannot run
fail when the data loads."""

from __future__ import annotations

import json
import resource
import time

import pytest

from rltrain.config.reward import CodeSandboxConfig, RewardConfig
from rltrain.data.prompt_rows import DataRowError, PromptExample
from rltrain.rewards import RewardManager
from rltrain.rewards.code_exec import extract_program

TESTS = json.dumps({"inputs": ["1 2\n", "10 -4\n", "0 0"], "outputs": ["3\n", "6", "0\n"]})
"""Sum two integers read from stdin."""

SOURCES = ["code", "apps", "codecontests", "codeforces", "taco"]


def fenced(program: str) -> str:
    return f"Here is my solution.\n```python\n{program}\n```\nIt reads the input."


@pytest.fixture(scope="module")
def manager() -> RewardManager:
    config = RewardConfig(format_score=0.1, sandbox=CodeSandboxConfig(timeout_s=1.0, memory_mb=256))
    return RewardManager.from_config(config)


def test_correct_programs_pass_and_wrong_ones_fail(manager: RewardManager) -> None:
    responses = [
        fenced("a, b = map(int, input().split())\nprint(a + b)"),
        # sys.stdin.buffer, open(0) and a main guard all see the test's input
        "```py\nimport sys\na, b = map(int, sys.stdin.buffer.read().split())\nsys.stdout.write(f'{a + b}\\n')\n```",
        fenced(
            "def main():\n    a, b = map(int, open(0).read().split())\n    print(a + b)\n\nif __name__ == '__main__':\n    main()"
        ),
        "a, b = map(int, input().split())\nprint(a + b)",  # no fence: the whole response runs
        fenced("a, b = map(int, input().split())\nprint(a * b)"),  # right on the last test only
        fenced("import sys\nprint(sum(map(int, input().split())))\nsys.exit(3)"),  # right output, exit 3
        fenced("print(3)"),  # right on the first test only
        "The sum is a + b.",  # no fence, not a program: 0
    ]
    out = manager(responses, ground_truths=[TESTS] * len(responses), data_sources=SOURCES + SOURCES[:3])
    assert out.scores.tolist() == pytest.approx([1.0, 1.0, 1.0, 1.0, 0.1, 0.1, 0.1, 0.0])
    assert out.correct.tolist() == [True, True, True, True, False, False, False, False]
    assert out.results[0].answer == "a, b = map(int, input().split())\nprint(a + b)\n"
    assert out.results[3].answer is None
    # the share of tests passed before the first failure: print(3) gets the first of three right
    assert [r.extra["tests_passed"] for r in out.results] == pytest.approx([1, 1, 1, 1, 0, 0, 1 / 3, 0])
    assert [r.extra.get("sandbox_error") for r in out.results] == [
        None
    ] * 8  # a syntax error is a failed test


def test_an_infinite_loop_and_a_memory_bomb_fail_within_the_limits(manager: RewardManager) -> None:
    before_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for program, error, limit_s in [
        ("while True:\n    pass", "timeout", 1.0 + 1.5),  # wall clock: reward.sandbox.timeout_s
        ("hoard = []\nwhile True:\n    hoard.append(bytearray(1 << 24))", "memory", 2.5),  # past 256 MB
        ("print(len(bytearray(1 << 34)))", "memory", 2.5),  # 16 GiB at once
    ]:
        start = time.monotonic()
        result = manager([fenced(program)], ground_truths=[TESTS], data_sources=["code"])
        assert (result.scores.tolist(), result.correct.tolist()) == ([pytest.approx(0.1)], [False]), program
        assert result.results[0].extra == {"tests_passed": 0.0, "sandbox_error": error}, program
        assert time.monotonic() - start < limit_s, program
    grown_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before_kb
    assert grown_kb < 64 * 1024, "the memory bomb went off in the test process"


def test_the_program_is_the_last_python_block() -> None:
    text = "```text\nnot this\n```\n```python\nfirst\n```\n```Python3\nsecond\n```\n```\nplain\n```"
    assert extract_program(text) == "second\n"
    assert extract_program("```python\nunclosed") is None


@pytest.mark.parametrize(
    ("truth", "problem"),
    [
        ("print(1)", 'is not JSON (a code ground truth is {"inputs": [...], "outputs": [...]})'),
        ('["assert f(1) == 2"]', 'is not a JSON object with "inputs" and "outputs" (stdin/stdout tests)'),
        (
            '{"fn_name": "f", "inputs": [[1]], "outputs": [2]}',
            "has call-based tests (fn_name); the code reward runs stdin/stdout tests only",
        ),
        ('{"inputs": ["1"], "outputs": []}', 'needs "inputs" and "outputs" as lists of the same length'),
        ('{"inputs": [], "outputs": []}', "has no tests"),
        (
            '{"inputs": [1], "outputs": ["1"]}',
            'needs strings in "inputs" and "outputs" (stdin and stdout texts)',
        ),
    ],
)
def test_ground_truths_it_cannot_run_fail_when_the_data_loads(truth: str, problem: str) -> None:
    row = PromptExample(
        index=0, prompt="p", ground_truth=truth, data_source="apps", extra_info={}, origin="code.jsonl:3"
    )
    with pytest.raises(DataRowError) as info:
        RewardManager().check_examples([row])
    assert info.value.problems == [
        f"code.jsonl:3: ground truth {truth!r} {problem}, which the 'apps' reward of data_source 'apps' needs"
    ]
    RewardManager().check_examples([PromptExample(**{**row.__dict__, "ground_truth": TESTS})])
