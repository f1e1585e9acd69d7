"""vLLM's module names for HF tensors: which HF tensors one vLLM module loads together.

vLLM fuses q/k/v into ``qkv_proj``, gate/up into ``gate_up_proj`` and all experts of a layer into one
fused-MoE module; its in-place loaders process a module once all its members arrived, so a weight
stream must keep those members together (``grouped_order``) and never cut them between two engine
calls (``rltrain.weight_sync.buckets.iter_buckets``). Pure: strings only.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import TypeVar

T = TypeVar("T")

# HF sub-module → vLLM fused module, the packing every vLLM decoder family in scope uses.
DEFAULT_PACKED_MODULES: dict[str, str] = {
    "q_proj": "qkv_proj",
    "k_proj": "qkv_proj",
    "v_proj": "qkv_proj",
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
    # DeepSeek-V2/V3 (MLA with a query latent): vLLM stacks the two down projections.
    "q_a_proj": "fused_qkv_a_proj",
    "kv_a_proj_with_mqa": "fused_qkv_a_proj",
}
# HF sub-modules that vLLM keeps whole on every TP rank although Megatron splits them: DeepSeek-V2/V3's
# query and KV down projections (vLLM builds their ``fused_qkv_a_proj`` with ``disable_tp=True``;
# Megatron's MLA splits ``linear_q_down_proj``/``linear_kv_down_proj`` over TP and gathers after).
VLLM_REPLICATED_MODULES = frozenset({"q_a_proj", "kv_a_proj_with_mqa"})


def vllm_replicates(hf_name: str) -> bool:
    """Whether vLLM loads ``hf_name`` whole on every TP rank whatever the trainer's split."""
    parts = hf_name.split(".")
    return len(parts) >= 2 and parts[-2] in VLLM_REPLICATED_MODULES


_EXPERT_INDEX = re.compile(r"\.experts\.\d+\.")


def fused_group(hf_name: str, packed_modules: dict[str, str] | None = None) -> str:
    """Name of the vLLM module that ``hf_name`` is loaded into (the unit a bucket must not split)."""
    packed = DEFAULT_PACKED_MODULES if packed_modules is None else packed_modules
    expert = _EXPERT_INDEX.search(hf_name)
    if expert is not None:
        return hf_name[: expert.start()] + ".experts"
    parts = hf_name.split(".")
    module = parts[:-1]
    if module and module[-1] in packed:
        module = [*module[:-1], packed[module[-1]]]
    return ".".join(module)


def grouped_order(
    named: Iterable[tuple[str, T]], packed_modules: dict[str, str] | None = None
) -> list[tuple[str, T]]:
    """``named`` reordered so that the members of each fused module are adjacent
    (stable otherwise: modules keep the order of their first member)."""
    items = list(named)
    first: dict[str, int] = {}
    for i, (name, _) in enumerate(items):
        first.setdefault(fused_group(name, packed_modules), i)
    return sorted(items, key=lambda kv: first[fused_group(kv[0], packed_modules)])
