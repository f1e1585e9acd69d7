"""Tiny models, batches and loss callables shared by the Megatron distributed tests."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from rltrain.algo.token_batch import LossFn, ModelOutput, TokenBatch
from rltrain.config.optim import OptimConfig
from rltrain.config.parallel import ParallelConfig
from rltrain.megatron.micro_batches import MicroBatching
from rltrain.megatron.parallel import ParallelContext
from rltrain.megatron.worker import MegatronWorker

SEED = 1234
VOCAB = 256


def ensure_process_group() -> None:
    """One gloo group for the whole case, so that several contexts can come and go on it."""
    if not dist.is_initialized():
        dist.init_process_group("gloo")


def tiny_llama(**overrides: Any) -> Any:
    from transformers import LlamaConfig

    kwargs = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        initializer_range=0.15,
        tie_word_embeddings=False,
    )
    kwargs.update(overrides)
    return LlamaConfig(**kwargs)


def tiny_mixtral(**overrides: Any) -> Any:
    from transformers import MixtralConfig

    kwargs = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        num_local_experts=4,
        num_experts_per_tok=2,
        router_aux_loss_coef=0.01,
        initializer_range=0.15,
        tie_word_embeddings=False,
    )
    kwargs.update(overrides)
    return MixtralConfig(**kwargs)


def make_batch(batch_size: int = 4, seq: int = 16, response_len: int = 8, seed: int = 0) -> TokenBatch:
    """Left-padded prompts and right-padded responses of different lengths, plus loss inputs."""
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, VOCAB, (batch_size, seq), generator=gen)
    mask = torch.ones(batch_size, seq, dtype=torch.long)
    prompt_len = seq - response_len
    for row in range(batch_size):
        mask[row, : row % 3] = 0  # left padding of the prompt
        mask[row, seq - (row * 2) % (response_len - 1) :] = (
            0 if row % 2 else 1
        )  # right padding of the response
    input_ids = input_ids * mask
    advantages = torch.randn(batch_size, response_len, generator=gen)
    returns = torch.randn(batch_size, response_len, generator=gen)
    assert mask[:, prompt_len - 1].all()
    return TokenBatch(
        input_ids=input_ids,
        attention_mask=mask,
        response_len=response_len,
        advantages=advantages,
        returns=returns,
    )


@torch.no_grad()
def hf_reference_logprobs(
    reference: Any, batch: TokenBatch
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """transformers' per-token log-probs and entropies of ``batch``'s responses ([batch, response],
    fp32, left-padded rows with positions from their first token) and the response mask (bool)."""
    mask = batch.attention_mask
    logits = reference(
        input_ids=batch.input_ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0)
    ).logits[:, -batch.response_len - 1 : -1]
    log_p = torch.log_softmax(logits.float(), -1)
    logprobs = log_p.gather(-1, batch.input_ids[:, -batch.response_len :, None]).squeeze(-1)
    return logprobs, -(log_p.exp() * log_p).sum(-1), batch.response_mask.bool()


def dp_shard(batch: TokenBatch, ctx: ParallelContext) -> TokenBatch:
    per_rank = batch.batch_size // ctx.dp_size
    return batch.select(list(range(ctx.dp_rank * per_rank, (ctx.dp_rank + 1) * per_rank)))


def policy_loss(global_tokens: float) -> LossFn:
    """A policy-gradient loss with an entropy bonus, normalized by the global response-token count."""

    def loss_fn(out: ModelOutput, mb: TokenBatch) -> tuple[torch.Tensor, dict]:
        mask = mb.response_mask.float()
        pg = -(out.logprobs * mb.advantages * mask).sum() / global_tokens
        ent = (out.entropy * mask).sum() / global_tokens
        return pg - 0.01 * ent, {"entropy": ent.detach()}

    return loss_fn


def value_loss(global_tokens: float) -> LossFn:
    def loss_fn(out: ModelOutput, mb: TokenBatch) -> tuple[torch.Tensor, dict]:
        mask = mb.response_mask.float()
        return 0.5 * (((out.values - mb.returns) ** 2) * mask).sum() / global_tokens, {}

    return loss_fn


def optim() -> OptimConfig:
    return OptimConfig(
        lr=1e-3, eps=1e-6, weight_decay=0.01, clip_grad=1.0, lr_warmup_steps=0, lr_decay_style="linear"
    )


def _two_train_steps(
    role: str,
    hf: Any,
    parallel: ParallelConfig,
    batching: MicroBatching,
    load_from: str | None,
    save_to: str | None,
) -> tuple[Any, Any, dict[str, torch.Tensor]]:
    """Build a ``role`` worker at ``parallel``, forward, two train steps, forward again.

    Returns the forward outputs before and after the first step, and the two steps' losses and grad norms.
    """
    forward, loss = {
        "actor": (MegatronWorker.compute_log_prob, policy_loss),
        "critic": (MegatronWorker.compute_values, value_loss),
    }[role]
    ensure_process_group()
    ctx = ParallelContext.initialize(parallel, seed=SEED)
    try:
        worker = MegatronWorker(hf, ctx=ctx, role=role, batching=batching, optim=optim(), total_steps=4)
        if load_from:
            worker.load_checkpoint(load_from, load_optimizer=False)
        if save_to:
            worker.save_checkpoint(save_to, step=0)
        batch = make_batch()
        tokens = float(batch.response_mask.sum())
        before = forward(worker, batch)
        first = worker.update(dp_shard(batch, ctx), loss(tokens))
        after = forward(worker, batch)
        second = worker.update(dp_shard(batch, ctx), loss(tokens))
        steps = {
            "loss": torch.tensor([first.metrics["loss"], second.metrics["loss"]]),
            "grad_norm": torch.tensor([first.grad_norm, second.grad_norm]),
        }
        return before, after, steps
    finally:
        ctx.destroy()


def actor_round(
    hf: Any,
    parallel: ParallelConfig,
    batching: MicroBatching,
    *,
    load_from: str | None = None,
    save_to: str | None = None,
) -> dict[str, Any]:
    """Build an actor at ``parallel``, forward, two train steps, forward again; numbers to compare."""
    before, after, steps = _two_train_steps("actor", hf, parallel, batching, load_from, save_to)
    return {
        "logprobs": before.logprobs,
        "entropy": before.entropy,
        **steps,
        "logprobs_after": after.logprobs,
    }


def critic_round(
    hf: Any,
    parallel: ParallelConfig,
    batching: MicroBatching,
    *,
    load_from: str | None = None,
    save_to: str | None = None,
) -> dict[str, Any]:
    values, after, steps = _two_train_steps("critic", hf, parallel, batching, load_from, save_to)
    return {"values": values, **steps, "values_after": after}


def max_diffs(reference: dict[str, torch.Tensor], other: dict[str, torch.Tensor]) -> dict[str, float]:
    """Max abs difference per output, relative to the output's scale when that exceeds 1 (fp32 keeps
    ~7 digits: a logprob of -20 cannot agree to 1e-5 absolute after a few reductions in another order)."""
    return {
        k: float(
            (reference[k].double() - other[k].double()).abs().max()
            / max(1.0, float(reference[k].abs().max()))
        )
        for k in reference
    }
