"""Trajectory counts, the step's agent metrics, the feedback interaction and the calculator reward."""

from __future__ import annotations

import asyncio

import pytest

from rltrain.agent.interactions import InteractionConfigError, load_interaction
from rltrain.agent.interactions.feedback import FeedbackInteraction
from rltrain.agent.loop import turn_seed
from rltrain.agent.trajectory import Trajectory, step_metrics
from rltrain.rewards import get_reward_fn


def test_trajectory_counts_tokens_by_source_and_metrics_average_over_the_step():
    a = Trajectory(prompt_ids=[1])
    a.add([5, 6], sampled=True, logprobs=[-0.5, -0.25])
    a.add([7, 7, 7], sampled=False)
    a.add([8], sampled=True, logprobs=[-1.0])
    a.num_turns, a.num_tool_calls, a.num_tool_errors, a.tool_seconds = 2, 1, 0, 0.5
    b = Trajectory(prompt_ids=[1])
    b.add([9], sampled=True, logprobs=[-0.1])
    b.num_turns, b.num_tool_calls, b.num_tool_errors, b.tool_seconds = 3, 3, 2, 1.0
    assert a.sampled_mask == [1, 1, 0, 0, 0, 1]
    assert a.logprobs == [-0.5, -0.25, 0.0, 0.0, 0.0, -1.0]
    m = step_metrics([a.metrics(), b.metrics()])
    assert m["agent/turns"] == 2.5
    assert m["agent/tool_calls"] == 2.0
    assert m["agent/model_tokens"] == 2.0  # (3 + 1) / 2
    assert m["agent/tool_tokens"] == 1.5
    assert m["agent/tool_error_rate"] == 0.5  # 2 errors / 4 calls
    assert m["agent/tool_latency_s"] == 0.375  # 1.5 s / 4 calls
    assert m["agent/aborted"] == 0.0
    assert step_metrics([]) == {}


def test_turn_seeds_differ_by_sample_and_turn_and_stay_none_unseeded():
    seeds = {turn_seed(7, s, t) for s in range(4) for t in range(3)}
    assert len(seeds) == 12 and all(0 <= x < 2**31 - 1 for x in seeds)
    assert turn_seed(7, 1, 2) == ((7 * 1_000_003 + 1) * 1_009 + 2) % (2**31 - 1)
    assert turn_seed(None, 1, 2) is None


def test_feedback_interaction_rewards_a_right_answer_and_asks_again_after_a_wrong_one():
    fb = FeedbackInteraction(retry_message="No.", correct_reward=1.0, wrong_reward=-0.5)

    async def run():
        state = await fb.start(ground_truth="12", data_source="arithmetic")
        return await fb.respond(state, "11", turn=1), await fb.respond(state, "12", turn=2)

    wrong, right = asyncio.run(run())
    assert (wrong.message, wrong.reward) == ("No.", -0.5)
    assert (right.message, right.reward) == (None, 1.0)


def test_interaction_file_errors_name_the_file_and_key(tmp_path):
    good = tmp_path / "good.yaml"
    good.write_text(
        "interaction:\n  - name: fb\n    class_name: feedback\n    config: {retry_message: again}\n"
    )
    loaded = load_interaction(good)
    assert isinstance(loaded, FeedbackInteraction) and loaded.retry_message == "again" and loaded.name == "fb"
    cases = {
        "interaction: {}\n": "'interaction' must be a list of exactly one entry",
        "interaction:\n  - name: x\n": "interaction[0].class_name is missing",
        "interaction:\n  - class_name: nope\n": "'nope' is neither a registered interaction (feedback)",
        "interaction:\n  - class_name: feedback\n    config: {bogus: 1}\n": "interaction[0].config:",
    }
    for i, (text, message) in enumerate(cases.items()):
        path = tmp_path / f"bad{i}.yaml"
        path.write_text(text)
        with pytest.raises(InteractionConfigError) as err:
            load_interaction(path)
        assert str(err.value).startswith(f"{path}: ") and message in str(err.value), str(err.value)
    with pytest.raises(InteractionConfigError, match="no such interaction file"):
        load_interaction(tmp_path / "missing.yaml")


@pytest.mark.parametrize(
    ("response", "score", "answer"),
    [
        ('<tool_call>\n{"name": "calculator"}\n</tool_call>879', 1.0, "879"),
        ("<tool_call>a</tool_call>870<tool_call>b</tool_call> 879. ", 1.0, "879"),
        ("879", 1.0, "879"),
        ("<tool_call>x</tool_call>878", 0.5, "878"),
        ("<tool_call>879</tool_call>", 0.0, None),  # the number inside the call is not an answer
        ("the answer is 879", 0.0, None),
    ],
)
def test_calculator_reward_scores_the_answer_after_the_last_call(response, score, answer):
    result = get_reward_fn("calculator")(response, "879", correct_score=1.0, format_score=0.5)
    assert (result.score, result.answer) == (score, answer)
