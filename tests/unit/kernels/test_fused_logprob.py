"""The fused chunked LM head + logprobs/entropy (torch path, one rank) equals the unfused computation
(materialised logits ``hidden @ weight.T / T`` → ``vocab_parallel_logprobs_entropy``) and a float64
``log_softmax``, in values and in the gradients of ``hidden`` and ``weight`` for a loss mixing both
outputs."""

from __future__ import annotations

import pytest
import torch

from kernels.fused_logprob import fused_logprobs_entropy
from rltrain.megatron.logprobs import vocab_parallel_logprobs_entropy

TOKENS, HIDDEN = 64, 32


def _inputs(rows: int, real: int, *, seed: int = 0, dtype: torch.dtype = torch.float32) -> tuple:
    """hidden [64, 32], weight [rows, 32] (rows ≥ real; padding rows hold large values that would
    dominate the softmax), targets over the real vocabulary, per-token loss weights."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(TOKENS, HIDDEN, generator=gen)
    weight = torch.randn(rows, HIDDEN, generator=gen) * (2.0 / HIDDEN**0.5)  # logits of std ~2
    weight[real:] = 5.0
    targets = torch.randint(0, real, (TOKENS,), generator=gen)
    w_lp, w_ent = torch.randn(TOKENS, generator=gen), torch.randn(TOKENS, generator=gen)
    return hidden.to(dtype), weight.to(dtype), targets, w_lp, w_ent


def _unfused(hidden, weight, targets, w_lp, w_ent, *, real: int, temperature: float) -> tuple:
    """The existing path: materialised logits (a matmul in the inputs' dtype), upcast, divided by the
    temperature → ``vocab_parallel_logprobs_entropy``; returns (logprobs, entropy, grad_h, grad_w)."""
    hidden, weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logprobs, entropy = vocab_parallel_logprobs_entropy(
        (hidden @ weight.t()).float() / temperature, targets, vocab_size=real
    )
    (logprobs * w_lp + entropy * w_ent).sum().backward()
    return logprobs.detach(), entropy.detach(), hidden.grad, weight.grad


def _exact(hidden, weight, targets, w_lp, w_ent, *, real: int, temperature: float) -> tuple:
    """An independent reference: ``log_softmax`` over the real columns, all in float64."""
    hidden, weight = hidden.double().requires_grad_(), weight.double().requires_grad_()
    log_p = torch.log_softmax((hidden @ weight.t())[:, :real] / temperature, dim=-1)
    logprobs = log_p.gather(-1, targets[:, None]).squeeze(-1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    (logprobs * w_lp.double() + entropy * w_ent.double()).sum().backward()
    return logprobs.detach(), entropy.detach(), hidden.grad, weight.grad


def _fused(hidden, weight, targets, w_lp, w_ent, **kwargs) -> tuple:
    hidden, weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logprobs, entropy = fused_logprobs_entropy(hidden, weight, targets, **kwargs)
    (logprobs * w_lp + entropy * w_ent).sum().backward()
    return logprobs.detach(), entropy.detach(), hidden.grad, weight.grad


def _max_diffs(got: tuple, want: tuple) -> dict[str, float]:
    names = ("logprobs", "entropy", "grad_hidden", "grad_weight")
    return {n: float((g.float() - w.float()).abs().max()) for n, g, w in zip(names, got, want)}


@pytest.mark.parametrize(
    ("real", "rows", "chunk_size", "temperature"),
    [
        (49152, 49152, 24, 1.0),  # chunks of 22, 21, 21 tokens
        (49149, 49152, 40, 0.6),  # 3 padded rows; chunks of 32
        (151936, 151936, 100, 1.7),  # one chunk larger than the tokens
        (151926, 151936, 24, 0.6),  # 10 padded rows
        (151936, 151936, None, 1.0),  # the default chunk (CHUNK_ELEMENTS // vocab = 441 tokens)
    ],
)
def test_fused_equals_full_log_softmax(
    real: int, rows: int, chunk_size: int | None, temperature: float
) -> None:
    hidden, weight, targets, w_lp, w_ent = _inputs(rows, real)
    got = _fused(
        hidden,
        weight,
        targets,
        w_lp,
        w_ent,
        vocab_size=real,
        temperature=temperature,
        chunk_size=chunk_size,
    )
    unfused = _unfused(hidden, weight, targets, w_lp, w_ent, real=real, temperature=temperature)
    exact = _exact(hidden, weight, targets, w_lp, w_ent, real=real, temperature=temperature)
    to_unfused, to_exact = _max_diffs(got, unfused), _max_diffs(got, exact)
    assert max(to_unfused.values()) <= 1e-5, to_unfused
    # float32 itself is this far from float64 here (the unfused path is, too: ~1e-5 at T = 0.6).
    assert max(to_exact.values()) <= 2e-5, to_exact
    assert float(exact[1].min()) > 1.0  # the entropy is far from a one-hot softmax: a real test of it
    assert float(got[3][real:].abs().sum()) == 0.0  # padding rows get no gradient


def test_backward_matches_finite_differences_in_float64() -> None:
    """gradcheck: leading dims [3, 5], padded rows, chunks of 4 over 15 tokens, temperature 0.7."""
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(3, 5, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(13, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 11, (3, 5), generator=gen)

    def op(h: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return fused_logprobs_entropy(h, w, targets, vocab_size=11, temperature=0.7, chunk_size=4)

    assert torch.autograd.gradcheck(op, (hidden, weight))


def test_logprobs_only_frozen_weight_and_no_tokens() -> None:
    """A loss on logprobs alone (entropy's gradient undefined), a frozen LM head, and zero tokens."""
    hidden, weight, targets, w_lp, _ = _inputs(1000, 990, seed=2)
    ref_hidden = hidden.clone().requires_grad_()
    log_p = torch.log_softmax(ref_hidden @ weight[:990].t(), dim=-1)
    (log_p.gather(-1, targets[:, None]).squeeze(-1) * w_lp).sum().backward()

    fused_hidden = hidden.clone().requires_grad_()
    logprobs, _ = fused_logprobs_entropy(fused_hidden, weight, targets, vocab_size=990, chunk_size=9)
    (logprobs * w_lp).sum().backward()
    assert float((fused_hidden.grad - ref_hidden.grad).abs().max()) <= 1e-5

    empty_lp, empty_ent = fused_logprobs_entropy(hidden[:0], weight, targets[:0], vocab_size=990)
    assert empty_lp.shape == empty_ent.shape == (0,)


def test_bfloat16_follows_the_unfused_bfloat16_path() -> None:
    """bf16 hidden and weight: per-chunk bf16 matmuls upcast per chunk, against bf16 full logits
    upcast once (the existing path); the gradients differ by bf16 rounding only."""
    real = 4000
    hidden, weight, targets, w_lp, w_ent = _inputs(4096, real, seed=3, dtype=torch.bfloat16)
    want = _unfused(hidden, weight, targets, w_lp, w_ent, real=real, temperature=0.8)
    got = _fused(hidden, weight, targets, w_lp, w_ent, vocab_size=real, temperature=0.8, chunk_size=10)
    assert got[0].dtype == got[1].dtype == torch.float32
    assert got[2].dtype == got[3].dtype == torch.bfloat16
    diffs = _max_diffs(got, want)
    assert diffs["logprobs"] <= 1e-5 and diffs["entropy"] <= 1e-5, diffs
    for name, index in (("grad_hidden", 2), ("grad_weight", 3)):
        scale = float(want[index].float().abs().max())
        assert diffs[name] <= 8e-3 * scale, (name, diffs[name], scale)  # one bf16 rounding


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"targets": torch.zeros(5, dtype=torch.long)}, "must be targets (5,) + [hidden_size]"),
        ({"weight": torch.zeros(8, 3)}, "weight (8, 3) must be [vocab / tp, 4]"),
        ({"weight": torch.zeros(8, 4, dtype=torch.float64)}, "differ"),
        ({"vocab_size": 9}, "vocab_size 9 is not in (0, 8]"),
        ({"temperature": 0.0}, "temperature must be > 0"),
        ({"chunk_size": 0}, "chunk_size must be >= 1"),
        ({"impl": "cuda"}, "impl: 'cuda' is not one of"),
    ],
)
def test_bad_arguments_name_what_is_wrong(kwargs: dict, message: str) -> None:
    args = {
        "hidden": torch.zeros(6, 4),
        "weight": torch.zeros(8, 4),
        "targets": torch.zeros(6, dtype=torch.long),
    }
    args.update({k: kwargs.pop(k) for k in list(kwargs) if k in args})
    with pytest.raises(ValueError) as err:
        fused_logprobs_entropy(args["hidden"], args["weight"], args["targets"], **kwargs)
    assert message in str(err.value)


def test_triton_on_cpu_tensors_says_what_it_needs() -> None:
    with pytest.raises(RuntimeError, match="needs CUDA tensors and the triton package"):
        fused_logprobs_entropy(
            torch.zeros(2, 4), torch.zeros(8, 4), torch.zeros(2, dtype=torch.long), impl="triton"
        )
