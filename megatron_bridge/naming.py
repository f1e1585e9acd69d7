"""Parameter-name patterns and the renames between Megatron naming variants.

Contract:
- A pattern is a dotted parameter name in which ``*`` stands for one non-negative integer (a layer
  or expert index). The first ``*`` of a Megatron pattern is the layer, a second one the expert;
  HF patterns use the same values in the same order.
- Bridge tables are written in *canonical* Megatron names: the local layer spec at TP = PP = EP = 1,
  i.e. global layer and expert indices. ``to_canonical``/``from_canonical`` translate the names a
  live model chunk reports (stage-local layer index, EP-local expert index, Transformer Engine
  spellings) to and from canonical ones. A multi-token-prediction layer's transformer layer
  (``mtp.layers.i.transformer_layer.*``) keeps its index (Megatron builds every MTP layer on the
  last stage) and has its experts offset like a decoder layer's. Pure string code, no torch, no Megatron.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
# A multi-token-prediction layer's transformer layer: its own index (no pipeline offset: Megatron
# builds every MTP layer on the last stage), experts and norms spelled as in a decoder layer.
_MTP_LAYER = re.compile(r"^(mtp\.layers\.\d+\.transformer_layer)\.(.*)$")
_LOCAL_EXPERT = re.compile(r"^(mlp\.experts\.)local_experts\.(\d+)\.(linear_fc[12])\.(weight|bias)$")
_GROUPED_EXPERT = re.compile(r"^(mlp\.experts\.)(linear_fc[12])\.(weight|bias)(\d+)$")

# Transformer Engine fuses the pre-attention and (dense) pre-MLP norms into the following linear.
_TE_FUSED_NORMS = {
    "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
    "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
}


@lru_cache(maxsize=512)
def _compile(pattern: str) -> re.Pattern[str]:
    return re.compile("^" + re.escape(pattern).replace(r"\*", r"(\d+)") + "$")


def match(pattern: str, name: str) -> tuple[int, ...] | None:
    """The wildcard values of ``name`` under ``pattern``, or None when it does not match."""
    m = _compile(pattern).match(name)
    return None if m is None else tuple(int(g) for g in m.groups())


def fill(pattern: str, values: tuple[int, ...]) -> str:
    """Substitute ``values`` for the ``*`` of ``pattern``, left to right; extra values are ignored."""
    parts = pattern.split("*")
    if len(values) < len(parts) - 1:
        raise ValueError(f"pattern {pattern!r} has {len(parts) - 1} wildcards, got values {values}")
    out = parts[0]
    for value, tail in zip(values, parts[1:]):
        out += str(value) + tail
    return out


def num_wildcards(pattern: str) -> int:
    return pattern.count("*")


@dataclass(frozen=True)
class ChunkNaming:
    """How one live model chunk spells its parameters relative to canonical names.

    Attributes:
        layer_offset: global index of the chunk's first decoder layer (PP stage / VPP chunk offset).
        expert_offset: global index of this rank's first local expert (``ep_rank * num_local_experts``).
        num_local_experts: experts held by this rank (0 for dense models).
        te_spec: the chunk was built with the Transformer Engine layer spec (fused norms).
        grouped_gemm: experts are a grouped GEMM (``linear_fc1.weight{e}``) instead of a list.
        moe: the decoder layers are MoE layers (TE keeps ``pre_mlp_layernorm`` unfused there).
    """

    layer_offset: int = 0
    expert_offset: int = 0
    num_local_experts: int = 0
    te_spec: bool = False
    grouped_gemm: bool = False
    moe: bool = False

    def to_canonical(self, name: str) -> str:
        """Canonical (global, local-spec) name of the chunk's parameter ``name``."""
        mtp = _MTP_LAYER.match(name)
        if mtp is not None:
            return f"{mtp.group(1)}.{self._canonical_rest(mtp.group(2))}"
        m = _LAYER.match(name)
        if m is None:
            return name
        layer = int(m.group(1)) + self.layer_offset
        return f"decoder.layers.{layer}.{self._canonical_rest(m.group(2))}"

    def _canonical_rest(self, rest: str) -> str:
        """A layer's parameter name below the layer, in canonical spelling."""
        if self.te_spec:
            for plain, fused in _TE_FUSED_NORMS.items():
                if rest.startswith(fused) and not (self.moe and plain == "pre_mlp_layernorm."):
                    rest = plain + rest[len(fused) :]
        g = _GROUPED_EXPERT.match(rest)
        if g is not None:
            expert = int(g.group(4)) + self.expert_offset
            rest = f"{g.group(1)}local_experts.{expert}.{g.group(2)}.{g.group(3)}"
        e = _LOCAL_EXPERT.match(rest)
        if e is not None and g is None:
            expert = int(e.group(2)) + self.expert_offset
            rest = f"{e.group(1)}local_experts.{expert}.{e.group(3)}.{e.group(4)}"
        return rest

    def from_canonical(self, name: str) -> str:
        """The chunk's own spelling of canonical ``name`` (inverse of ``to_canonical``)."""
        mtp = _MTP_LAYER.match(name)
        if mtp is not None:
            return f"{mtp.group(1)}.{self._local_rest(mtp.group(2))}"
        m = _LAYER.match(name)
        if m is None:
            return name
        layer = int(m.group(1)) - self.layer_offset
        return f"decoder.layers.{layer}.{self._local_rest(m.group(2))}"

    def _local_rest(self, rest: str) -> str:
        """A layer's parameter name below the layer, in the chunk's spelling."""
        e = _LOCAL_EXPERT.match(rest)
        if e is not None:
            expert = int(e.group(2)) - self.expert_offset
            if self.grouped_gemm:
                rest = f"{e.group(1)}{e.group(3)}.{e.group(4)}{expert}"
            else:
                rest = f"{e.group(1)}local_experts.{expert}.{e.group(3)}.{e.group(4)}"
        if self.te_spec:
            for plain, fused in _TE_FUSED_NORMS.items():
                if rest.startswith(plain) and not (self.moe and plain == "pre_mlp_layernorm."):
                    rest = fused + rest[len(plain) :]
        return rest

    def owns_expert(self, canonical: str) -> bool:
        """Whether canonical expert parameter ``canonical`` lives on this rank (True for non-experts)."""
        m = _LAYER.match(canonical) or _MTP_LAYER.match(canonical)
        e = _LOCAL_EXPERT.match(m.group(2)) if m else None
        if e is None:
            return True
        return self.expert_offset <= int(e.group(2)) < self.expert_offset + self.num_local_experts
