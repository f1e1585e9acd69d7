"""Resource pools (``cluster.resource_pools``, ``cluster.role_pool``) and the reward model's keys
(``reward.reward_model``): what loads, what each role's world is, and every layout that cannot work
named in one line with its role and pool."""

from rltrain.config import load_config

from .recipe_helpers import MINIMAL, errors_of, write

RM = ["reward.reward_model.enable=true", "reward.reward_model.model.path=/models/rm"]


def _errors(tmp_path, overrides):
    return [p.split(": ", 1)[1] for p in errors_of(write(tmp_path, "r.yaml", MINIMAL), overrides)]


def _load(tmp_path, overrides):
    return load_config(write(tmp_path, "r.yaml", MINIMAL), overrides)


def test_roles_default_to_the_trainers_pool(tmp_path):
    config = _load(tmp_path, ["cluster.n_gpus_per_node=2", *RM])
    assert config.pool_roles() == {"global_pool": ["actor", "critic", "reward_model"]}
    assert [config.role_world(r) for r in ("actor", "critic", "reward_model")] == [2, 2, 2]
    rm = config.reward.reward_model
    assert (rm.score_weight, rm.rule_weight, rm.micro_batch_size_per_gpu) == (1.0, 0.0, 4)


def test_named_pools_set_each_roles_world(tmp_path):
    config = _load(
        tmp_path,
        [
            "cluster.n_gpus_per_node=2",
            "cluster.resource_pools.critic_pool.nnodes=2",
            "cluster.resource_pools.critic_pool.n_gpus_per_node=2",
            "critic.ppo_micro_batch_size_per_gpu=1",
            "cluster.resource_pools.rm_pool.nnodes=2",
            "cluster.role_pool.critic=critic_pool",
            "cluster.role_pool.reward_model=rm_pool",
            "reward.reward_model.parallel.tensor_model_parallel_size=2",
            *RM,
        ],
    )
    assert config.pool_roles() == {
        "global_pool": ["actor"],
        "critic_pool": ["critic"],
        "rm_pool": ["reward_model"],
    }
    assert [config.role_world(r) for r in ("actor", "critic", "reward_model")] == [2, 4, 2]
    # two roles on one named pool share it
    shared = _load(
        tmp_path,
        [
            "cluster.resource_pools.aux.n_gpus_per_node=2",
            "cluster.role_pool.critic=aux",
            "cluster.role_pool.reward_model=aux",
            *RM,
        ],
    )
    assert shared.pool_roles() == {"global_pool": ["actor"], "aux": ["critic", "reward_model"]}


def test_pool_problems_name_the_role_and_pool(tmp_path):
    assert _errors(tmp_path, ["cluster.role_pool.critic=nope"]) == [
        "cluster.role_pool.critic='nope' names no pool; known: ['global_pool']"
    ]
    assert _errors(tmp_path, ["cluster.resource_pools.spare.n_gpus_per_node=2"]) == [
        "cluster.resource_pools.spare hosts no role (cluster.role_pool names it for no enabled critic, "
        "reward model or separate rollout)"
    ]
    assert _errors(tmp_path, ["cluster.resource_pools.global_pool.n_gpus_per_node=2"]) == [
        "cluster.resource_pools.global_pool is the trainer's own pool (cluster.nnodes × "
        "cluster.n_gpus_per_node): name the others differently"
    ]
    # a pool for a role the run does not have
    assert _errors(
        tmp_path,
        ["cluster.resource_pools.rm_pool.n_gpus_per_node=1", "cluster.role_pool.reward_model=rm_pool"],
    ) == [
        "cluster.resource_pools.rm_pool hosts no role (cluster.role_pool names it for no enabled critic, "
        "reward model or separate rollout)",
        "cluster.role_pool.reward_model=rm_pool but the run has no reward_model (reward.reward_model.enable)",
    ]


def test_a_layout_that_does_not_fit_its_pool_is_refused_naming_the_role(tmp_path):
    pool = ["cluster.resource_pools.p.n_gpus_per_node=3"]
    assert _errors(
        tmp_path, [*pool, "cluster.role_pool.critic=p", "critic.parallel.tensor_model_parallel_size=2"]
    ) == ["critic.parallel: TP×PP×CP = 2×1×1 = 2 does not divide the 3 devices given to the role"]
    # the critic's mini-batch splits over its own pool's data-parallel ranks (4 prompts × n=1 over 3)
    assert errors_of(write(tmp_path, "r.yaml", MINIMAL), [*pool, "cluster.role_pool.critic=p"]) == [
        "critic.ppo_mini_batch_size × rollout.n = 4×1 = 4 samples do not split over the 3 data-parallel ranks "
        "of the critic"
    ]
    assert _errors(tmp_path, [*pool, "cluster.role_pool.reward_model=p", *RM]) == [
        "data.train_batch_size × rollout.n = 8 samples do not split over the 3 data-parallel ranks of the reward model"
    ]
    rm_tp = [
        "cluster.resource_pools.p.n_gpus_per_node=2",
        "cluster.role_pool.reward_model=p",
        "reward.reward_model.parallel.tensor_model_parallel_size=4",
        *RM,
    ]
    assert _errors(tmp_path, rm_tp) == [
        "reward.reward_model.parallel: TP×PP×CP = 4×1×1 = 4 does not divide the 2 devices given to the role"
    ]


def test_separate_engines_on_a_named_pool(tmp_path):
    engines = ["rollout.mode=separate", "rollout.weight_sync.transport=broadcast"]
    pool = ["cluster.resource_pools.gen.n_gpus_per_node=2", "cluster.role_pool.rollout=gen"]
    config = _load(tmp_path, [*engines, "rollout.num_devices=2", *pool])
    assert config.pool_roles() == {"global_pool": ["actor", "critic"], "gen": ["rollout"]}
    assert _errors(tmp_path, [*engines, "rollout.num_devices=1", *pool]) == [
        "rollout.num_devices=1 differs from the 2 devices of its pool cluster.resource_pools.gen"
    ]
    assert _errors(tmp_path, pool) == [
        "cluster.role_pool.rollout=gen places engines on devices of their own: needs rollout.mode=separate, "
        "got colocated"
    ]
    assert _errors(tmp_path, [*engines, "rollout.num_devices=2", *pool, "cluster.role_pool.critic=gen"]) == [
        "cluster.resource_pools.gen hosts the separate rollout engines, which hold their devices whole: it "
        "cannot host critic too"
    ]
    assert _errors(tmp_path, ["cluster.role_pool.rollout=global_pool"]) == [
        "cluster.role_pool.rollout=global_pool: engines on the actor's devices are rollout.mode=colocated "
        "(leave role_pool.rollout null)"
    ]


def test_reward_model_problems(tmp_path):
    assert _errors(tmp_path, ["reward.reward_model.enable=true"]) == [
        "reward.reward_model.enable=true needs reward.reward_model.model.path (an HF sequence-classification dir)"
    ]
    longest = _errors(tmp_path, [*RM, "reward.reward_model.max_length=16", "data.max_prompt_length=64"])
    assert longest == [
        "reward.reward_model.max_length=16 is shorter than the longest sequence (data.max_prompt_length + "
        f"rollout.response_length = {64 + _load(tmp_path, []).rollout.response_length})"
    ]
    assert _errors(tmp_path, [*RM, "reward.reward_model.score_weight=0"]) == [
        "reward.reward_model.score_weight=0 ignores the model it enables"
    ]
    assert _errors(
        tmp_path, ["cluster.resource_pools.p.n_gpus_per_node=0", "cluster.role_pool.critic=p"]
    ) == ["cluster.resource_pools.p.n_gpus_per_node must be >= 1, got 0"]
