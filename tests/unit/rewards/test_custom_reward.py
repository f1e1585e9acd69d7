"""reward.custom_reward_function: a function loaded from a file scores every row as verl calls it; an
independent re-implementation of the strict arithmetic reward scores exactly like the built-in one;
bad files and bad answers stop in one line naming the file and the key; the scorer travels to other
processes by path."""

from __future__ import annotations

import pickle
import sys
import textwrap

import pytest

from rltrain.config.reward import CustomRewardFunctionConfig, RewardConfig
from rltrain.rewards import RewardError, RewardManager
from rltrain.rewards.custom import CustomReward, RewardFunctionError

# Strict arithmetic (rltrain.rewards.math_answers.arithmetic_reward) written again without its regex:
# the response is an integer, surrounding whitespace and one trailing period allowed.
ARITHMETIC_AGAIN = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None, *, format_score):
    body = solution_str.strip()
    if body.endswith("."):
        body = body[:-1]
    digits = body[1:] if body.startswith("-") else body
    if not digits.isdecimal():
        return 0.0
    return 1.0 if int(body) == int(ground_truth) else format_score
"""

SAMPLES = [  # (response, ground truth)
    ("12", "12"),
    (" 7.\n", "7"),
    ("7 .", "7"),
    ("-3", "-3"),
    ("+3", "3"),
    ("3.0", "3"),
    ("00012", "12"),
    ("13", "12"),
    ("The answer is 9", "9"),
    ("", "1"),
    ("\u0663", "3"),  # an Arabic-Indic 3: a decimal digit for both
    ("1..", "1"),
]


def write(tmp_path, text: str, name: str = "my_reward.py") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def custom_manager(path: str, **kwargs) -> RewardManager:
    config = RewardConfig(
        format_score=0.1, custom_reward_function=CustomRewardFunctionConfig(path=path, **kwargs)
    )
    return RewardManager.from_config(config)


def test_a_custom_function_by_path_scores_like_the_built_in_reward(tmp_path) -> None:
    manager = custom_manager(write(tmp_path, ARITHMETIC_AGAIN), reward_kwargs={"format_score": 0.1})
    responses, truths = zip(*SAMPLES)
    # the custom function scores every row: the data_source names no registered reward here
    custom = manager(list(responses), ground_truths=list(truths), data_sources=["my/arith"] * len(SAMPLES))
    built_in = RewardManager(format_score=0.1)(
        list(responses), ground_truths=list(truths), data_sources=["arithmetic"] * len(SAMPLES)
    )
    assert custom.scores.tolist() == built_in.scores.tolist()
    assert custom.correct.tolist() == built_in.correct.tolist()
    # by hand: 12, " 7.", -3, 00012 and the Arabic-Indic 3 are right; 13 is a wrong integer (0.1)
    assert custom.scores.tolist() == pytest.approx([1, 1, 0, 1, 0, 0, 1, 0.1, 0, 0, 1, 0])
    assert custom.metrics["reward/accuracy"] == pytest.approx(5 / 12)
    assert manager.score_one("13", "12", "my/arith").score == pytest.approx(0.1)


def test_verl_arguments_kwargs_and_dict_answers(tmp_path) -> None:
    path = write(
        tmp_path,
        """
        def judge(*, data_source, solution_str, ground_truth, extra_info, bonus):
            if data_source == "as_bool":
                return solution_str == ground_truth
            if data_source == "as_int":
                return len(solution_str)
            return {"score": bonus + extra_info["weight"], "acc": solution_str == ground_truth,
                    "pred": solution_str.upper(), "steps": extra_info["weight"] * 10, "note": "text"}
        """,
    )
    manager = custom_manager(path, name="judge", reward_kwargs={"bonus": 0.5})
    out = manager(
        ["a", "b", "abc", "x"],
        ground_truths=["a", "a", "", "x"],
        data_sources=["as_bool", "as_bool", "as_int", "as_dict"],
        extra_infos=[{}, {}, {}, {"weight": 0.25}],
    )
    assert out.scores.tolist() == [1.0, 0.0, 3.0, 0.75]
    # a plain number counts as correct at reward.correct_score (1.0) or more; a dict's acc decides
    assert out.correct.tolist() == [True, False, True, True]
    assert [r.answer for r in out.results] == [None, None, None, "X"]
    assert out.results[3].extra == {"acc": True, "pred": "X", "steps": 2.5, "note": "text"}
    assert out.metrics["reward/extra/acc/mean"] == 1.0
    assert out.metrics["reward/extra/steps/mean"] == 2.5
    assert "reward/extra/note/mean" not in out.metrics and "reward/extra/pred/mean" not in out.metrics


def test_rows_need_no_registered_reward_when_a_custom_function_scores(tmp_path) -> None:
    from rltrain.data.prompt_rows import PromptExample

    row = PromptExample(
        index=0, prompt="p", ground_truth="anything", data_source="mine", extra_info={}, origin="d.jsonl:1"
    )
    custom_manager(write(tmp_path, ARITHMETIC_AGAIN), reward_kwargs={"format_score": 0}).check_examples([row])


def one_line_error(tmp_path, text: str | None, **kwargs) -> str:
    path = str(tmp_path / "missing.py") if text is None else write(tmp_path, text)
    with pytest.raises(RewardFunctionError) as info:
        custom_manager(path, **kwargs)
    message = str(info.value)
    assert "\n" not in message and f"reward.custom_reward_function.path={path!r}" in message
    return message.removeprefix(f"invalid configuration: reward.custom_reward_function.path={path!r}: ")


def test_bad_files_fail_when_the_manager_is_built_in_one_line(tmp_path) -> None:
    assert one_line_error(tmp_path, None) == f"no such file ({tmp_path / 'missing.py'})"
    assert one_line_error(tmp_path, "def compute_score(:\n    pass\n").startswith("syntax error at line 1: ")
    assert one_line_error(tmp_path, "import not_a_module_anywhere\n") == (
        "importing it raised ModuleNotFoundError: No module named 'not_a_module_anywhere'"
    )
    assert one_line_error(tmp_path, "def score(x):\n    return 1\n") == (
        f"no function 'compute_score' (reward.custom_reward_function.name) in {tmp_path / 'my_reward.py'}; "
        "its functions: ['score']"
    )
    assert one_line_error(tmp_path, "compute_score = 3\n") == (
        "'compute_score' (reward.custom_reward_function.name) is not callable (a value of type int)"
    )
    assert one_line_error(tmp_path, "def compute_score(solution_str, ground_truth):\n    return 1\n") == (
        "compute_score() cannot be called as compute_score(data_source=, solution_str=, ground_truth=, "
        "extra_info=, plus reward.custom_reward_function.reward_kwargs []): got an unexpected keyword "
        "argument 'data_source'"
    )
    with pytest.raises(RewardFunctionError, match=r"reward_kwargs may not set \['ground_truth'\]"):
        custom_manager(write(tmp_path, ARITHMETIC_AGAIN, "r2.py"), reward_kwargs={"ground_truth": "1"})


@pytest.mark.parametrize(
    ("answer", "what"),
    [
        (
            "'high'",
            "the answer is 'high' (str); a reward answers a number, a bool or a dict with a numeric 'score'",
        ),
        (
            "None",
            "the answer is None (NoneType); a reward answers a number, a bool or a dict with a numeric 'score'",
        ),
        (
            "{'reward': 1.0}",
            "the answer {'reward': 1.0} has no 'score' key; a reward answers a number, a bool or a dict with "
            "a numeric 'score'",
        ),
        ("{'score': '1'}", "the answer's 'score' is '1' (str), not a number"),
        ("float('nan')", "the score is nan; it must be finite"),
    ],
)
def test_an_answer_that_is_not_a_score_stops_in_one_line(tmp_path, answer: str, what: str) -> None:
    path = write(
        tmp_path,
        f"def compute_score(data_source, solution_str, ground_truth, extra_info):\n    return {answer}\n",
    )
    manager = custom_manager(path)
    with pytest.raises(RewardError) as info:
        manager(["x"], ground_truths=["1"], data_sources=["gsm8k"])
    assert str(info.value) == (
        f"reward.custom_reward_function.path={path!r}: compute_score(): for data_source 'gsm8k' {what}"
    )


def test_the_scorer_travels_by_path_and_loads_again_where_it_lands(tmp_path) -> None:
    counter = tmp_path / "loads.txt"
    path = write(
        tmp_path,
        f"""
        with open({str(counter)!r}, "a") as f:
            f.write("x")

        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            return float(solution_str == ground_truth)
        """,
    )
    manager = custom_manager(path)
    assert counter.read_text() == "x"
    custom_manager(path)  # loaded once per process
    assert counter.read_text() == "x"
    blob = pickle.dumps(manager)
    scorer = manager.scorer
    assert isinstance(scorer, CustomReward)
    del sys.modules[next(name for name, m in sys.modules.items() if getattr(m, "__file__", None) == path)]
    landed = pickle.loads(blob)  # as in a fresh Ray task: the module is not loaded there
    assert landed.scorer._fn is None
    assert landed(["a", "b"], ground_truths=["a", "a"], data_sources=["s", "s"]).scores.tolist() == [1.0, 0.0]
    assert counter.read_text() == "xx"
