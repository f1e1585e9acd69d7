"""The Triton chunk kernels (``impl="triton"``) equal the torch path on a GPU, in values and in the
gradients of ``hidden`` and ``weight``; float32 also against a float64 ``log_softmax``."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from kernels.fused_logprob import fused_logprobs_entropy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or importlib.util.find_spec("triton") is None,
        reason="needs CUDA and triton",
    ),
]


def _run(hidden, weight, targets, w_lp, w_ent, **kwargs) -> tuple:
    hidden, weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logprobs, entropy = fused_logprobs_entropy(hidden, weight, targets, **kwargs)
    (logprobs * w_lp + entropy * w_ent).sum().backward()
    return logprobs.detach(), entropy.detach(), hidden.grad, weight.grad


@pytest.mark.parametrize(("dtype", "grad_tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_triton_equals_torch_path(dtype: torch.dtype, grad_tolerance: float) -> None:
    """300 tokens in chunks of at most 128, vocab 151,936 with 10 padded rows (large values that
    must be ignored), temperature 0.7. Both paths upcast the same logits, so the values agree to
    float32 rounding in either dtype; bf16 gradients are compared relative to their largest entry."""
    gen = torch.Generator().manual_seed(0)
    tokens, hidden_size, rows, real = 300, 64, 151936, 151926
    hidden = torch.randn(tokens, hidden_size, generator=gen)
    weight = torch.randn(rows, hidden_size, generator=gen) * (2.0 / hidden_size**0.5)
    weight[real:] = 5.0
    targets = torch.randint(0, real, (tokens,), generator=gen)
    w_lp, w_ent = torch.randn(tokens, generator=gen), torch.randn(tokens, generator=gen)
    args = [t.cuda() for t in (hidden.to(dtype), weight.to(dtype), targets, w_lp, w_ent)]
    common = {"vocab_size": real, "temperature": 0.7, "chunk_size": 128}
    want = _run(*args, impl="torch", **common)
    got = _run(*args, impl="triton", **common)
    for name, g, w in zip(("logprobs", "entropy", "grad_hidden", "grad_weight"), got, want):
        diff = float((g.float() - w.float()).abs().max())
        if name in ("logprobs", "entropy"):
            assert diff <= 2e-5, (name, diff)
        else:
            scale = 1.0 if dtype == torch.float32 else float(w.float().abs().max())
            assert diff <= grad_tolerance * scale, (name, diff, scale)
    assert float(got[3][real:].abs().sum()) == 0.0
    if dtype == torch.float32:
        h64, w64 = args[0].double(), args[1].double()
        log_p = torch.log_softmax((h64 @ w64.t())[:, :real] / 0.7, dim=-1)
        logprobs = log_p.gather(-1, args[2][:, None]).squeeze(-1)
        entropy = -(log_p.exp() * log_p).sum(-1)
        assert float((got[0] - logprobs).abs().max()) <= 2e-5
        assert float((got[1] - entropy).abs().max()) <= 2e-5
