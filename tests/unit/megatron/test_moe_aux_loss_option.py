"""``model.moe.moe_aux_loss_coeff`` overrides the checkpoint's ``router_aux_loss_coef`` (gpt-oss-20b
releases 0.9, which transformers applies only when asked for router logits), 0 turning the
load-balancing loss off; null keeps the checkpoint's."""

import pytest
import torch

from rltrain.config import load_config
from rltrain.config.moe import MoEConfig
from rltrain.config.parallel import ParallelConfig
from rltrain.megatron.model_config import transformer_config_from_hf
from tests.released import shrunk_config


def _config(**options):
    from transformers import AutoConfig

    hf = AutoConfig.for_model(**shrunk_config("gpt-oss-20b") | {"quantization_config": None})
    return transformer_config_from_hf(
        hf, parallel=ParallelConfig(), params_dtype=torch.float32, moe_options=MoEConfig(**options)
    )


def test_null_keeps_the_checkpoints_coefficient_and_a_value_replaces_it():
    released = _config()
    assert released.moe_aux_loss_coeff == 0.9 and released.moe_router_load_balancing_type == "aux_loss"
    lighter = _config(moe_aux_loss_coeff=0.001)
    assert lighter.moe_aux_loss_coeff == 0.001 and lighter.moe_router_load_balancing_type == "aux_loss"
    off = _config(moe_aux_loss_coeff=0.0)
    assert off.moe_aux_loss_coeff == 0.0 and off.moe_router_load_balancing_type == "none"


def test_a_negative_coefficient_is_refused_naming_the_key():
    with pytest.raises(Exception, match=r"model\.moe\.moe_aux_loss_coeff must be >= 0, got -0\.1"):
        load_config("recipes/quickstart_cpu.yaml", ["model.moe.moe_aux_loss_coeff=-0.1"])
