"""A tiny HF reward model trained on synthetic preferences, and the rank function that scores with
its Megatron twin (``role="reward"`` loaded through the bridge) at several layouts.

The preference is learnable in a few steps: a chosen response contains the token ``GOOD`` somewhere,
a rejected one (drawn independently) never does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron_fixtures import SEED, ensure_process_group

from rltrain.algo.token_batch import TokenBatch
from rltrain.config.parallel import ParallelConfig
from rltrain.megatron.micro_batches import MicroBatching

VOCAB, PAD, GOOD = 32, 0, 1
FIRST_PLAIN = 3
"""Prompt and response tokens other than ``GOOD`` are drawn from [FIRST_PLAIN, VOCAB); ``PAD`` never
appears inside a sequence (HF pools at the last token that is not ``pad_token_id``)."""


@dataclass(frozen=True)
class Pair:
    prompt: list[int]
    chosen: list[int]
    rejected: list[int]


def reward_model_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        num_labels=1,
        pad_token_id=PAD,
    )


def preference_pairs(num_pairs: int, *, seed: int) -> list[Pair]:
    """Prompts of 2–6 tokens; responses of 1–6 tokens, the chosen one with ``GOOD`` at a random place."""
    gen = torch.Generator().manual_seed(seed)

    def randint(low: int, high: int, n: int = 1) -> list[int]:
        return torch.randint(low, high, (n,), generator=gen).tolist()

    pairs = []
    for _ in range(num_pairs):
        prompt = randint(FIRST_PLAIN, VOCAB, randint(2, 7)[0])
        chosen = randint(FIRST_PLAIN, VOCAB, randint(1, 7)[0])
        chosen[randint(0, len(chosen))[0]] = GOOD
        rejected = randint(FIRST_PLAIN, VOCAB, randint(1, 7)[0])
        pairs.append(Pair(prompt, chosen, rejected))
    return pairs


def hf_scores(model, sequences: list[list[int]]) -> torch.Tensor:
    """[len(sequences)] the HF classifier's own scores: right-padded rows with ``PAD``, its pooling."""
    width = max(map(len, sequences))
    input_ids = torch.full((len(sequences), width), PAD)
    mask = torch.zeros_like(input_ids)
    for row, seq in enumerate(sequences):
        input_ids[row, : len(seq)] = torch.tensor(seq)
        mask[row, : len(seq)] = 1
    return model(input_ids=input_ids, attention_mask=mask).logits.squeeze(-1).float()


def _pair_scores(model, pairs: list[Pair]) -> tuple[torch.Tensor, torch.Tensor]:
    scores = hf_scores(model, [p.prompt + p.chosen for p in pairs] + [p.prompt + p.rejected for p in pairs])
    return scores[: len(pairs)], scores[len(pairs) :]


@torch.no_grad()
def pair_accuracy(model, pairs: list[Pair]) -> float:
    """Fraction of pairs whose chosen response scores above the rejected one."""
    chosen, rejected = _pair_scores(model, pairs)
    return float((chosen > rejected).float().mean())


def train_bradley_terry(model, pairs: list[Pair], *, steps: int, batch_size: int, lr: float) -> list[float]:
    """Adam on the Bradley–Terry loss -log σ(r_chosen - r_rejected); returns the per-step losses."""
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    losses = []
    for step in range(steps):
        batch = [pairs[(step * batch_size + i) % len(pairs)] for i in range(batch_size)]
        chosen, rejected = _pair_scores(model, batch)
        loss = -F.logsigmoid(chosen - rejected).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    model.eval()
    return losses


def token_batch(rows: list[tuple[list[int], list[int]]], *, odd_length: bool = False) -> TokenBatch:
    """(prompt, response) rows in the trainer's layout: left-padded prompts, right-padded responses;
    ``odd_length``: one more prompt column if the rows would have an even length."""
    prompt_len = max(len(p) for p, _ in rows)
    if odd_length and (prompt_len + max(len(r) for _, r in rows)) % 2 == 0:
        prompt_len += 1
    response_len = max(len(r) for _, r in rows)
    input_ids = torch.zeros(len(rows), prompt_len + response_len, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for row, (prompt, response) in enumerate(rows):
        input_ids[row, prompt_len - len(prompt) : prompt_len] = torch.tensor(prompt)
        mask[row, prompt_len - len(prompt) : prompt_len] = 1
        if response:
            input_ids[row, prompt_len : prompt_len + len(response)] = torch.tensor(response)
            mask[row, prompt_len : prompt_len + len(response)] = 1
    return TokenBatch(input_ids=input_ids, attention_mask=mask, response_len=response_len)


LAYOUTS: dict[str, tuple[ParallelConfig, MicroBatching]] = {
    # Two data-parallel ranks, each its half in packed micro-batches of 3/3/... rows.
    "tp1_dp2_packed": (ParallelConfig(), MicroBatching(micro_batch_size=3, use_remove_padding=True)),
    # Padded rows, the sequence split over TP (an odd length: the prompt side gets one more pad).
    "tp2_sp_padded": (
        ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True),
        MicroBatching(micro_batch_size=4, use_remove_padding=False),
    ),
    "tp2_dynamic_packed": (
        ParallelConfig(tensor_model_parallel_size=2),
        MicroBatching(use_dynamic_bsz=True, max_token_len=30, use_remove_padding=True),
    ),
    # The head on the second stage; the scores broadcast back to the first.
    "pp2_dynamic_packed": (
        ParallelConfig(pipeline_model_parallel_size=2),
        MicroBatching(use_dynamic_bsz=True, max_token_len=30, use_remove_padding=True),
    ),
}


def reward_scores_case(model_dir: str, batch: TokenBatch) -> dict[str, tuple[list[int], str, list[float]]]:
    """Per layout: (rows this rank scored, the scores' dtype, the scores) from a Megatron reward model
    loaded from the HF checkpoint ``model_dir`` by the trainer's ``load_hf_into`` (plain Python values:
    tensors would travel through shared memory that dies with the rank)."""
    from transformers import AutoConfig

    from rltrain.megatron.parallel import ParallelContext
    from rltrain.megatron.worker import MegatronWorker
    from rltrain.workers.rank_base import load_hf_into

    ensure_process_group()
    hf_config = AutoConfig.from_pretrained(model_dir)
    out = {}
    for name, (parallel, batching) in LAYOUTS.items():
        ctx = ParallelContext.initialize(parallel, seed=SEED)
        try:
            worker = MegatronWorker(hf_config, ctx=ctx, role="reward", batching=batching)
            load_hf_into(worker, ctx=ctx, hf_config=hf_config, model_dir=model_dir)
            per_rank = batch.batch_size // ctx.dp_size
            rows = list(range(ctx.dp_rank * per_rank, (ctx.dp_rank + 1) * per_rank))
            scores = worker.compute_rm_scores(batch.select(rows))
            out[name] = (rows, str(scores.dtype), scores.tolist())
        finally:
            ctx.destroy()
    return out
