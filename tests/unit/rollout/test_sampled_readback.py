"""The engine readback under a ``DigestRequest`` (``rltrain.rollout.vllm.checksum``), on plain torch
modules shaped as vLLM's: only the named tensors, on their sampled columns; a fused-MoE module it
cannot read is skipped in sampled mode and refused in full mode."""

from __future__ import annotations

import pytest
import torch

from rltrain.rollout.vllm.checksum import engine_hf_weights
from rltrain.weight_sync.sampling import DigestRequest, sample_columns


class _Experts(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w13_weight = torch.nn.Parameter(torch.zeros(2, 4, 3))


class _Layer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.Module()
        self.norm.weight = torch.nn.Parameter(torch.arange(20.0))
        self.experts = _Experts()


class MixtralForCausalLM(torch.nn.Module):  # a fused-MoE model the readback cannot read
    def __init__(self) -> None:
        super().__init__()
        self.layer = _Layer()


def test_a_request_reads_only_its_tensors_on_their_columns():
    model = MixtralForCausalLM()
    request = DigestRequest(3, {"layer.norm.weight": True}, skip_unsupported=True)
    (name, tensor), *rest = list(engine_hf_weights(model, request))
    assert rest == [] and name == "layer.norm.weight"
    assert tensor.tolist() == [float(c) for c in sample_columns("layer.norm.weight", 3, 20)]
    whole = DigestRequest(0, {"layer.norm.weight": False}, skip_unsupported=True)
    assert [t.tolist() for _, t in engine_hf_weights(model, whole)] == [list(map(float, range(20)))]


def test_unreadable_experts_are_skipped_when_sampled_and_refused_in_full():
    model = MixtralForCausalLM()
    sampled = DigestRequest(0, {"layer.norm.weight": False, "layer.experts.w13_weight": False}, True)
    assert [n for n, _ in engine_hf_weights(model, sampled)] == ["layer.norm.weight"]
    full = DigestRequest(0, {"layer.norm.weight": False}, skip_unsupported=False)
    with pytest.raises(NotImplementedError, match="verify MoE syncs by logprobs instead"):
        list(engine_hf_weights(model, full))
