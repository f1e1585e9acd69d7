"""``_Counter.check_complete_groups``: a weight stream that fills part of one of vLLM's fused modules
is refused, naming it; multi-latent attention's own ``q_proj`` (DeepSeek-V2-Lite) is not fused."""

from __future__ import annotations

import pytest
import torch

from rltrain.rollout.vllm.receive import _Counter
from rltrain.weight_sync.types import TensorRegions


def consumed(names: list[str]) -> _Counter:
    counter = _Counter(TensorRegions.whole(n, torch.zeros(2)) for n in names)
    assert [u.name for u in counter] == names
    return counter


def test_a_half_filled_qkv_or_gate_up_module_is_refused_naming_it():
    attn = "model.layers.0.self_attn."
    consumed([attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight"]).check_complete_groups()
    with pytest.raises(
        ValueError,
        match=r"partial weight load into fused module 'model\.layers\.0\.self_attn\.qkv_proj': "
        r"got \['q_proj'\], missing \['k_proj', 'v_proj'\]",
    ):
        consumed([attn + "q_proj.weight", attn + "o_proj.weight"]).check_complete_groups()
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.gate_up_proj': got \['up_proj'\]"):
        consumed(["model.layers.0.mlp.up_proj.weight"]).check_complete_groups()


def test_mla_direct_query_projection_is_a_module_of_its_own():
    attn = "model.layers.1.self_attn."
    lite = [attn + "q_proj.weight", attn + "kv_a_proj_with_mqa.weight", attn + "kv_b_proj.weight"]
    consumed(lite).check_complete_groups()
    # ... but only in its own layer: a llama layer beside it still needs its k and v
    with pytest.raises(ValueError, match=r"'model\.layers\.2\.self_attn\.qkv_proj'"):
        consumed([*lite, "model.layers.2.self_attn.q_proj.weight"]).check_complete_groups()
