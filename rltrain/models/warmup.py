"""Supervised warm-up of a small HF causal LM on prompt → answer pairs (teacher forcing).

A randomly initialised model never emits a correct answer, so RL from it has no signal. The CPU
quickstart first fits the policy for a few hundred steps on the task's answers; the loss covers
only the answer tokens and the end-of-text token that follows them.
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)


@dataclass
class WarmupResult:
    first_loss: float
    """Mean answer-token loss of the first step."""

    last_loss: float
    """Mean answer-token loss over the last 10 steps."""

    steps: int
    """Optimizer steps taken."""

    loss_floor: float = 0.0
    """The lowest the loss can reach: with label smoothing the entropy of the smoothed target
    (``smoothed_loss_floor``), 0 without."""


def encode_pairs(tokenizer, pairs: list[tuple[list[dict], str]]) -> list[tuple[list[int], list[int]]]:
    """Chat-templated prompt ids and answer ids (answer + ``eos``) per (messages, answer) pair."""
    encoded = []
    for messages, answer in pairs:
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        prompt_ids = list(
            prompt["input_ids"] if isinstance(prompt, dict) or hasattr(prompt, "keys") else prompt
        )
        answer_ids = [*tokenizer.encode(answer, add_special_tokens=False), tokenizer.eos_token_id]
        encoded.append((prompt_ids, answer_ids))
    return encoded


def sft_warmup(
    model: torch.nn.Module,
    tokenizer,
    pairs: list[tuple[list[dict], str]],
    *,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
    label_smoothing: float = 0.0,
) -> WarmupResult:
    """Fit ``model`` in place on ``pairs`` for ``steps`` AdamW steps; returns the loss trajectory."""
    if not pairs:
        raise ValueError("sft_warmup needs at least one (prompt, answer) pair")
    sequences = [(p + a, [0] * len(p) + [1] * len(a)) for p, a in encode_pairs(tokenizer, pairs)]
    return fit_sequences(
        model,
        sequences,
        pad_token_id=tokenizer.pad_token_id,
        steps=steps,
        batch_size=batch_size,
        lr=lr,
        seed=seed,
        label_smoothing=label_smoothing,
    )


@contextlib.contextmanager
def _deterministic_algorithms():
    """torch's deterministic algorithms for the block, then the caller's setting back. The MoE families
    whose transformers experts gather their tokens by index (GPT-OSS) otherwise add the gradient rows
    of that gather in a racing order on more than one CPU thread, and the warm-up, hence a whole run,
    differed from one run to the next (measured: two 300-step warm-ups, two threads, two models)."""
    enabled, warn_only = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    # an op without a deterministic CPU kernel warns rather than stops the warm-up
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


def fit_sequences(
    model: torch.nn.Module,
    sequences: list[tuple[list[int], list[int]]],
    *,
    pad_token_id: int,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
    label_smoothing: float = 0.0,
) -> WarmupResult:
    """Fit ``model`` in place on ``(token ids, loss mask)`` sequences (the loss covers the tokens whose
    mask is 1: an answer, or every assistant turn of a conversation) for ``steps`` AdamW steps, by
    cross-entropy with ``label_smoothing`` (the target keeps 1 - ``label_smoothing`` on the token
    and spreads the rest evenly over the vocabulary; 0: the model's own loss)."""
    if not sequences:
        raise ValueError("fit_sequences needs at least one sequence")
    order = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 - step / max(steps, 1))
    pad = pad_token_id
    model.train()
    losses = []
    with _deterministic_algorithms():
        for _ in range(steps):
            batch = [sequences[order.randrange(len(sequences))] for _ in range(batch_size)]
            input_ids, labels = _collate(batch, pad)
            loss = _answer_loss(model, input_ids, labels, pad=pad, label_smoothing=label_smoothing)
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            losses.append(loss.item())
            if steps >= 200 and len(losses) % (steps // 4) == 0 and len(losses) < steps:
                recent = losses[-10:]
                log.info("sft warm-up: step %d/%d, loss %.3f", len(losses), steps, sum(recent) / len(recent))
    model.eval()
    vocab = model.get_output_embeddings().weight.size(0)
    result = WarmupResult(
        first_loss=losses[0],
        last_loss=sum(losses[-10:]) / len(losses[-10:]),
        steps=steps,
        loss_floor=smoothed_loss_floor(label_smoothing, vocab),
    )
    floor = (
        f" (label smoothing {label_smoothing:g}: its floor is {result.loss_floor:.3f}, the entropy of the "
        f"smoothed target over {vocab} tokens)"
        if label_smoothing
        else ""
    )
    log.info(
        "sft warm-up: %d steps, answer loss %.3f -> %.3f%s", steps, result.first_loss, result.last_loss, floor
    )
    return result


def smoothed_loss_floor(label_smoothing: float, vocab_size: int) -> float:
    """The minimum of cross-entropy with ``label_smoothing`` over ``vocab_size`` tokens: the entropy
    of its target, 1 - e + e/V on the label and e/V on each other token (0 when e = 0)."""
    if not label_smoothing:
        return 0.0
    on, off = 1.0 - label_smoothing + label_smoothing / vocab_size, label_smoothing / vocab_size
    return -(on * math.log(on) + (vocab_size - 1) * off * math.log(off))


def _answer_loss(
    model: torch.nn.Module, input_ids: torch.Tensor, labels: torch.Tensor, *, pad: int, label_smoothing: float
) -> torch.Tensor:
    """Mean next-token cross-entropy over the labelled tokens (``labels`` != -100)."""
    attention_mask = (input_ids != pad).long()
    if not label_smoothing:
        return model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(),
        labels[:, 1:].flatten(),
        ignore_index=-100,
        label_smoothing=label_smoothing,
    )


def _collate(batch: list[tuple[list[int], list[int]]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    length = max(len(ids) for ids, _ in batch)
    input_ids = torch.full((len(batch), length), pad, dtype=torch.long)
    labels = torch.full((len(batch), length), -100, dtype=torch.long)
    for row, (ids, mask) in enumerate(batch):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        labels[row, : len(ids)] = torch.where(torch.tensor(mask).bool(), torch.tensor(ids), -100)
    return input_ids, labels


@torch.no_grad()
def greedy_accuracy(
    model, tokenizer, pairs: list[tuple[list[dict], str]], *, max_new_tokens: int = 8
) -> float:
    """Fraction of pairs whose greedy continuation (up to eos) equals the answer exactly."""
    correct = 0
    for prompt_ids, answer_ids in encode_pairs(tokenizer, pairs):
        ids = torch.tensor([prompt_ids])
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        correct += out[0, len(prompt_ids) :].tolist()[: len(answer_ids)] == answer_ids
    return correct / len(pairs)
