"""Which parallel layouts a model can take, read from its HF config alone (nothing is built).

Contract: ``layout_problems(config, tp=, pp=, ...)`` lists every reason Megatron cannot split the
model of ``config`` (a ``PretrainedConfig`` or the dict of its ``config.json``) over that layout,
each naming both numbers (``tensor_model_parallel_size=4 does not divide num_key_value_heads=2``);
empty when the layout fits. The family (and so its experts) comes from the config's ``model_type``;
an unknown one raises ``KeyError`` listing the supported model types. The Megatron model builder
refuses the same layouts with the same words, so a launcher can check before any rank starts.
"""

from __future__ import annotations

from typing import Any

from megatron_bridge.family import MoEFacts, config_value
from megatron_bridge.registry import get_family


def layout_problems(
    config: Any,
    *,
    tp: int,
    pp: int,
    ep: int = 1,
    vpp: int = 1,
    etp: int | None = None,
    moe: MoEFacts | None = None,
) -> list[str]:
    """Problems of splitting the model of ``config`` over TP × PP (× virtual stages) × EP, expert-TP
    ``etp`` (default ``tp``). ``moe``: the model's experts when the caller has them already (default:
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
        (
            "pipeline_model_parallel_size × virtual",
            pp * vpp,
            "num_hidden_layers",
            config_value(config, "num_hidden_layers"),
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
    return [f"{lhs}={a} does not divide {rhs}={b}" for lhs, a, rhs, b in checks if b == 0 or b % a]
