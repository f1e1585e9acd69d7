"""Rollout placement: engine ranks, engine count and bundles by hand, for each mode; no Ray needed."""

import subprocess
import sys
from pathlib import Path

import pytest

from rltrain.config import load_config
from rltrain.orchestrator.placement import Bundle, RolloutPlacement, rollout_placement

REPO_ROOT = Path(__file__).resolve().parents[3]


def config(tmp_path, *overrides: str):
    """The quickstart recipe, micro-batches small enough for up to four data-parallel ranks."""
    return load_config(
        REPO_ROOT / "recipes/quickstart_cpu.yaml",
        [
            f"trainer.default_local_dir={tmp_path}",
            "actor.ppo_micro_batch_size_per_gpu=8",
            "critic.ppo_micro_batch_size_per_gpu=8",
            *overrides,
        ],
    )


def test_colocated_tp1_puts_an_engine_on_every_rank(tmp_path):
    layout = rollout_placement(config(tmp_path, "cluster.n_gpus_per_node=4"), gpu=True)
    assert layout == RolloutPlacement(
        mode="colocated",
        engine_tp=1,
        engine_ranks=(0, 1, 2, 3),
        num_engines=4,
        trainer_bundles=(Bundle(num_cpus=1, num_gpus=1),) * 4,
        engine_bundles=(),
    )
    assert not layout.separate
    assert [b.resources() for b in layout.bundles] == [{"CPU": 1, "GPU": 1}] * 4


def test_colocated_tp2_puts_an_engine_on_every_second_rank(tmp_path):
    cfg = config(tmp_path, "cluster.n_gpus_per_node=4", "rollout.tensor_model_parallel_size=2")
    layout = rollout_placement(cfg, gpu=True)
    assert (layout.engine_tp, layout.engine_ranks, layout.num_engines) == (2, (0, 2), 2)
    assert layout.engine_bundles == ()
    assert [b.resources() for b in layout.bundles] == [{"CPU": 1, "GPU": 1}] * 4


def test_colocated_on_cpus_reserves_one_cpu_per_rank(tmp_path):
    cfg = config(
        tmp_path, "cluster.nnodes=2", "cluster.n_gpus_per_node=2", "rollout.tensor_model_parallel_size=2"
    )
    layout = rollout_placement(cfg, gpu=False)
    assert layout.engine_ranks == (0, 2)
    assert [b.resources() for b in layout.bundles] == [{"CPU": 1}] * 4


def test_separate_engines_get_bundles_of_their_own_after_the_trainer(tmp_path):
    cfg = config(
        tmp_path,
        "cluster.n_gpus_per_node=2",
        "rollout.mode=separate",
        "rollout.num_devices=4",
        "rollout.tensor_model_parallel_size=2",
    )
    gpu = rollout_placement(cfg, gpu=True)
    assert (gpu.mode, gpu.engine_tp, gpu.engine_ranks, gpu.num_engines) == ("separate", 2, (), 2)
    assert gpu.separate and gpu.first_engine_bundle == 2
    assert [b.resources() for b in gpu.bundles] == [{"CPU": 1, "GPU": 1}] * 2 + [{"CPU": 1, "GPU": 2}] * 2
    cpu = rollout_placement(cfg, gpu=False)
    assert (cpu.engine_ranks, cpu.num_engines, cpu.first_engine_bundle) == ((), 2, 2)
    assert [b.resources() for b in cpu.bundles] == [{"CPU": 1}] * 4


def test_policy_role_refuses_a_separate_group_that_contradicts_the_placement(tmp_path):
    from rltrain.orchestrator.roles import PolicyRole

    colocated = rollout_placement(config(tmp_path), gpu=False)
    with pytest.raises(ValueError, match=r"rollout\.mode=colocated needs no separate engine group"):
        PolicyRole(group=None, placement=colocated, separate=object())
    separate = rollout_placement(
        config(tmp_path, "rollout.mode=separate", "rollout.num_devices=1"), gpu=False
    )
    with pytest.raises(ValueError, match=r"rollout\.mode=separate needs a separate engine group"):
        PolicyRole(group=None, placement=separate)


def test_placement_imports_without_ray():
    script = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'ray':\n"
        "            raise ImportError(f'blocked import of {name}')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import rltrain.orchestrator.placement\n"
        "assert 'ray' not in sys.modules\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
