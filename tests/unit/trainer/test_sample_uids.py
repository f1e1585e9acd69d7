"""Sample ids (``StepBatch.uids``): made per rollout by ``build_step_batch``, carried through select,
chunk and concat, and unique in dynamic sampling's merged batch, where each sample keeps its round's."""

import torch

from rltrain.config.algorithm import FilterGroupsConfig
from rltrain.data.loader import PromptBatch
from rltrain.data.prompt_rows import PromptExample
from rltrain.data.step_batch import StepBatch, build_step_batch, sample_uids, step_uid_prefix
from rltrain.trainer.dynamic_sampling import ScoredRound, fill_batch


def _batch(prefix: str, num_prompts: int = 3, n: int = 2) -> StepBatch:
    return build_step_batch(
        prompt_ids=[[1 + p] * (1 + p) for p in range(num_prompts)],
        response_ids=[[10 + k] for k in range(num_prompts * n)],
        response_logprobs=[[-0.5]] * (num_prompts * n),
        finish_reasons=["stop"] * (num_prompts * n),
        n=n,
        data_sources=["arithmetic"] * num_prompts,
        ground_truths=["0"] * num_prompts,
        pad_token_id=0,
        response_length=2,
        uid_prefix=prefix,
    )


def test_ids_name_step_rollout_prompt_and_sample():
    assert [step_uid_prefix(3), step_uid_prefix(3, "r1"), step_uid_prefix(3, "greedy")] == [
        "step3",
        "step3-r1",
        "step3-greedy",
    ]
    assert sample_uids("step3-val", 2, 2) == [
        "step3-val-p0-s0",
        "step3-val-p0-s1",
        "step3-val-p1-s0",
        "step3-val-p1-s1",
    ]
    assert _batch("step7").uids == [
        "step7-p0-s0",
        "step7-p0-s1",
        "step7-p1-s0",
        "step7-p1-s1",
        "step7-p2-s0",
        "step7-p2-s1",
    ]
    assert _batch("").uids[:2] == ["p0-s0", "p0-s1"]


def test_ids_follow_their_rows_through_select_chunk_and_concat():
    batch = _batch("step2")
    token_of = dict(zip(batch.uids, batch.response_ids[:, 0].tolist()))
    picked = batch.select([5, 0, 3])
    assert picked.uids == ["step2-p2-s1", "step2-p0-s0", "step2-p1-s1"]
    assert [token_of[u] for u in picked.uids] == picked.response_ids[:, 0].tolist()
    parts = batch.chunk(3)
    assert [p.uids for p in parts] == [batch.uids[0:2], batch.uids[2:4], batch.uids[4:6]]
    assert StepBatch.concat(parts[::-1]).uids == batch.uids[4:6] + batch.uids[2:4] + batch.uids[0:2]


def test_dynamic_sampling_keeps_each_round_s_ids_unique_in_the_merged_batch():
    def scored(prefix: str, correct: list[bool]) -> ScoredRound:
        batch = _batch(prefix)
        batch.scores = torch.tensor([float(c) for c in correct])
        examples = [
            PromptExample(
                index=i, prompt="", ground_truth="0", data_source="arithmetic", extra_info={}, origin=""
            )
            for i in range(3)
        ]
        return ScoredRound(PromptBatch(examples, epoch=0, position=0), batch, torch.tensor(correct))

    # round 0 keeps p1 only; round 1 keeps p0 and p2, p0 being the same prompt position as round 0's
    first = scored("step4", [True, True, True, False, False, False])
    second = scored("step4-r1", [True, False, True, True, False, True])
    batch, _, _ = fill_batch(
        first,
        lambda r: second,
        config=FilterGroupsConfig(enable=True, metric="acc"),
        train_batch_size=3,
        n=2,
        pad_token_id=0,
        step=4,
    )
    assert batch.uids == [
        "step4-p1-s0", "step4-p1-s1", "step4-r1-p0-s0", "step4-r1-p0-s1", "step4-r1-p2-s0", "step4-r1-p2-s1",
    ]  # fmt: skip
    assert len(set(batch.uids)) == batch.batch_size
    assert batch.response_ids[:, 0].tolist() == [12, 13, 10, 11, 14, 15]  # the rows the ids name
