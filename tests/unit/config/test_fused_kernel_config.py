"""``model.use_fused_kernels`` / ``model.fused_kernel_options`` (verl's keys): off by default, and what
the policy worker builds its actor and reference with when on."""

from rltrain.config import load_config
from rltrain.workers.rank_base import fused_head

from .recipe_helpers import MINIMAL, errors_of, write


def test_fused_kernel_keys_reach_the_policy_workers_head(tmp_path):
    from rltrain.megatron.head_outputs import FusedHead

    path = write(tmp_path, "r.yaml", MINIMAL)
    assert fused_head(load_config(path)) is None
    on = load_config(path, ["model.use_fused_kernels=true", "model.fused_kernel_options.chunk_size=512"])
    assert fused_head(on) == FusedHead(impl="torch", chunk_size=512)
    triton = load_config(
        path, ["model.use_fused_kernels=true", "model.fused_kernel_options.impl_backend=triton"]
    )
    assert fused_head(triton) == FusedHead(impl="triton", chunk_size=None)
    assert errors_of(path, ["model.fused_kernel_options.impl_backend=cuda"]) == [
        "override 'model.fused_kernel_options.impl_backend=cuda': model.fused_kernel_options.impl_backend: "
        "'cuda' is not one of ['torch', 'triton']"
    ]
