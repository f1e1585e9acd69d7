"""Which parallel layouts a model can take, read from its HF config alone (nothing is built).

Contract: ``layout_problems(config, tp=, pp=, ...)`` lists every reason Megatron cannot split the
model of ``config`` (a ``PretrainedConfig`` or the dict of its ``config.json``) over that layout,
each naming both numbers (``tensor_model_parallel_size=4 does not divide num_key_value_heads=2``);
empty when the layout fits. ``stage_problems`` / ``chunk_layers`` / ``stage_of_layer`` are Megatron-Core's
pipeline split (even, or uneven with ``num_layers_in_first/last_pipeline_stage``) as pure functions: which
global decoder layers each (stage, virtual chunk) holds. The family (and so its experts) comes from the config's ``model_type``;
an unknown one raises ``KeyError`` listing the supported model types. The Megatron model builder
refuses the same layouts with the same words, so a launcher can check before any rank starts.
"""

from __future__ import annotations

from typing import Any

from megatron_bridge.family import MoEFacts
from megatron_bridge.hf_config import config_value
from megatron_bridge.registry import get_family

FIRST = "num_layers_in_first_pipeline_stage"
LAST = "num_layers_in_last_pipeline_stage"


def stage_problems(
    num_layers: int, *, pp: int, vpp: int = 1, first: int | None = None, last: int | None = None
) -> list[str]:
    """Why ``num_layers`` decoder layers cannot be split over ``pp`` stages (× ``vpp`` virtual chunks)
    with ``first``/``last`` layers on the first/last stage (Megatron-Core's uneven-PP checks); each
    problem names the keys and their numbers."""
    if first is None and last is None:
        if num_layers % (pp * vpp):
            return [
                f"pipeline_model_parallel_size × virtual={pp * vpp} does not divide num_hidden_layers={num_layers}"
                f" (set {FIRST} / {LAST} for uneven stages)"
            ]
        return []
    set_keys = [(k, v) for k, v in ((FIRST, first), (LAST, last)) if v is not None]
    if pp < 2:
        return [f"{k}={v} needs pipeline_model_parallel_size >= 2 (got {pp})" for k, v in set_keys]
    problems = [f"{k}={v} must be at least 1" for k, v in set_keys if v < 1]
    problems += [
        f"{k}={v} is not a multiple of virtual_pipeline_model_parallel_size={vpp}"
        for k, v in set_keys
        if vpp > 1 and v % vpp
    ]
    if problems:
        return problems
    middle_layers = num_layers - sum(v for _, v in set_keys)
    middle_stages = pp - len(set_keys)
    named = " + ".join(f"{k}={v}" for k, v in set_keys)
    if middle_layers < 0 or bool(middle_layers) != bool(middle_stages):
        return [
            f"{named} leaves {middle_layers} of num_hidden_layers={num_layers} for the "
            f"{middle_stages} middle stage(s) of pipeline_model_parallel_size={pp}"
        ]
    if middle_stages and middle_layers % (middle_stages * vpp):
        return [
            f"{named} leaves {middle_layers} of num_hidden_layers={num_layers}, which the {middle_stages} "
            f"other stage(s) × virtual={vpp} do not divide"
        ]
    return []


def chunk_layers(
    num_layers: int,
    *,
    pp_rank: int,
    pp: int,
    vp_stage: int = 0,
    vpp: int = 1,
    first: int | None = None,
    last: int | None = None,
) -> range:
    """Global decoder layers of model chunk ``vp_stage`` on stage ``pp_rank`` (Megatron-Core's
    ``get_transformer_layer_offset`` / ``get_num_layers_to_build``, even or uneven); raises
    ``ValueError`` with ``stage_problems``' words when the split does not add up."""
    problems = stage_problems(num_layers, pp=pp, vpp=vpp, first=first, last=last)
    if problems:
        raise ValueError("; ".join(problems))
    ends = [first, last] if pp > 1 else [None, None]
    middle_stages = pp - sum(v is not None for v in ends)
    middle_layers = num_layers - sum(v or 0 for v in ends)
    per_chunk = [middle_layers // (middle_stages * vpp) if middle_stages else 0] * pp
    if first is not None and pp > 1:
        per_chunk[0] = first // vpp
    if last is not None and pp > 1:
        per_chunk[-1] = last // vpp
    start = vp_stage * sum(per_chunk) + sum(per_chunk[:pp_rank])
    return range(start, start + per_chunk[pp_rank])


def stage_of_layer(
    layer: int, num_layers: int, *, pp: int, vpp: int = 1, first: int | None = None, last: int | None = None
) -> int:
    """The pipeline stage that holds global decoder layer ``layer``."""
    for rank in range(pp):
        for vp in range(vpp):
            kw = dict(pp_rank=rank, pp=pp, vp_stage=vp, vpp=vpp, first=first, last=last)
            if layer in chunk_layers(num_layers, **kw):
                return rank
    raise ValueError(f"layer {layer} is outside num_hidden_layers={num_layers}")


def layout_problems(
    config: Any,
    *,
    tp: int,
    pp: int,
    ep: int = 1,
    vpp: int = 1,
    etp: int | None = None,
    moe: MoEFacts | None = None,
    first: int | None = None,
    last: int | None = None,
) -> list[str]:
    """Problems of splitting the model of ``config`` over TP × PP (× virtual stages) × EP, expert-TP
    ``etp`` (default ``tp``), with ``first``/``last`` decoder layers on the first/last pipeline stage
    (default: an even split). ``moe``: the model's experts when the caller has them already (default:
    its family's facts for ``config``)."""
    if moe is None:
        moe = get_family(config_value(config, "model_type")).facts(config).moe
    heads = config_value(config, "num_attention_heads")
    checks = [
        ("tensor_model_parallel_size", tp, "num_attention_heads", heads),
        (
            "tensor_model_parallel_size",
            tp,
            "num_key_value_heads",
            config_value(config, "num_key_value_heads", default=heads),
        ),
    ]
    if moe:
        checks.append(("expert_model_parallel_size", ep, "num_experts", moe.num_experts))
        checks.append(
            ("expert_tensor_parallel_size", etp or tp, "moe_intermediate_size", moe.ffn_hidden_size)
        )
    else:
        checks.append(
            ("tensor_model_parallel_size", tp, "intermediate_size", config_value(config, "intermediate_size"))
        )
        if ep > 1:
            checks.append(("expert_model_parallel_size", ep, "num_experts", 0))
    problems = [f"{lhs}={a} does not divide {rhs}={b}" for lhs, a, rhs, b in checks if b == 0 or b % a]
    if moe and moe.biased_experts and (etp or tp) != 1:
        # TransformerConfig.__post_init__: "Bias in Moe is only supported when ETP==1"
        problems.append(
            f"expert_tensor_parallel_size={etp or tp} with biased experts: Megatron-Core 0.16.1 needs "
            "expert_tensor_parallel_size=1 (set it; tensor parallelism stays on attention)"
        )
    layers = config_value(config, "num_hidden_layers")
    return problems + stage_problems(layers, pp=pp, vpp=vpp, first=first, last=last)
