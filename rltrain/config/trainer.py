"""The run: steps, schedule of saves and evals, logging, checkpoints, devices."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from rltrain.config.fields import NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt
from rltrain.config.pools import GLOBAL_POOL, ResourcePoolConfig, RolePoolConfig
from rltrain.requirements import OPTIONAL, WANDB


@dataclass
class CheckpointConfig:
    max_ckpt_to_keep: int | None = 3
    """Complete checkpoints kept (oldest deleted first); null keeps all."""

    save_optimizer: bool = True
    """Save optimizer and scheduler state (needed to resume exactly)."""

    discard_existing: bool = False
    """With ``trainer.resume_mode: disable``: delete the checkpoints already in the run directory and
    start from step 0. Without it such a run is refused (a run directory holding checkpoints is never
    restarted by accident); a new run directory is the other choice."""


@dataclass
class TimeoutConfig:
    """How long the driver waits for each kind of call to a role's workers. A call that is not back
    in time stops the run (or, with ``trainer.max_restarts``, restarts the workers) with one line
    naming the role, the ranks that did not answer and the method: a stopped process, a deadlock or a
    collective stuck on a peer never hangs the run."""

    init_s: PositiveFloat = 1800.0
    """Starting a role's ranks (model build, HF weights, engine start), connecting weight-sync groups,
    and placing the run's resources on the cluster."""

    generate_s: PositiveFloat = 1800.0
    """One rollout (all samples of a step, or a validation pass)."""

    compute_s: PositiveFloat = 900.0
    """One forward pass over a step batch: old and reference log-probs, critic values."""

    update_s: PositiveFloat = 1800.0
    """One role update (every optimizer step of a PPO step)."""

    weight_sync_s: PositiveFloat = 600.0
    """Moving the actor's weights to the engines."""

    checkpoint_s: PositiveFloat = 1800.0
    """Saving or loading a role's checkpoint."""

    reward_s: PositiveFloat = 600.0
    """Scoring one step's responses in Ray tasks (``reward.num_workers`` > 0)."""

    call_s: PositiveFloat = 300.0
    """Any other call (rank layout, rendezvous addresses)."""

    liveness_s: NonNegativeFloat = 30.0
    """Apart from the deadlines above: while the driver waits for any call, every rank of every role
    is asked every few seconds whether its process lives (answered on a thread of its own, whatever
    the rank is doing); a rank silent this long, or one whose child process (an engine) stays
    stopped this long, is named as frozen and handled like a dead worker (``trainer.max_restarts``)
    long before a step's deadline. 0 turns the questions off (:mod:`rltrain.orchestrator.liveness`)."""

    collective_s: PositiveFloat = 1800.0
    """A wait inside one torch.distributed collective on a worker (Megatron's process groups, the
    weight-sync broadcast group); the waiting rank then fails naming itself. Keep it above the call
    timeouts so that the driver, which sees which ranks did not answer, reports first. In the torchrun
    mode every call ends in a collective over the ranks, so there it bounds each call."""


@dataclass
class ClusterConfig:
    nnodes: int = 1
    """Nodes in the run."""

    n_gpus_per_node: int = 1
    """Devices per node (on CPU: trainer processes per node)."""

    ray_address: str | None = None
    """Ray cluster to join; null uses ``RAY_ADDRESS`` or starts a local Ray."""

    num_cpus: int | None = None
    """CPUs for a locally started Ray; null lets Ray decide."""

    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """torch.distributed backend; auto is NCCL with CUDA, gloo without."""

    resource_pools: dict[str, ResourcePoolConfig] = field(default_factory=dict)
    """Named pools of devices beside the trainer's ``global_pool`` (``nnodes × n_gpus_per_node``),
    e.g. ``{critic_pool: {nnodes: 1, n_gpus_per_node: 2}}``; see :mod:`rltrain.config.pools`."""

    role_pool: RolePoolConfig = field(default_factory=RolePoolConfig)
    """Which pool the critic, the reward model and the separate rollout engines run on."""

    device_resource: str | None = None
    """The Ray resource one device is: null means ``GPU`` on a GPU cluster and none on a CPU one
    (bundles then reserve one CPU each); a custom resource's name (one a cluster declares with
    ``ray start --resources``) makes every bundle reserve one of it instead, e.g. to stand in for
    GPUs on a CPU test cluster."""

    def world_size(self) -> int:
        """Devices of the trainer's pool (``global_pool``)."""
        return self.nnodes * self.n_gpus_per_node

    def pool_size(self, name: str) -> int:
        """Devices of the pool ``name`` (``global_pool`` or a ``resource_pools`` key)."""
        return self.world_size() if name == GLOBAL_POOL else self.resource_pools[name].size()

    def validate(self, prefix: str) -> list[str]:
        problems = []
        if self.nnodes < 1:
            problems.append(f"{prefix}.nnodes must be >= 1, got {self.nnodes}")
        if self.n_gpus_per_node < 1:
            problems.append(f"{prefix}.n_gpus_per_node must be >= 1, got {self.n_gpus_per_node}")
        if self.num_cpus is not None and self.num_cpus < 1:
            problems.append(f"{prefix}.num_cpus must be >= 1 or null, got {self.num_cpus}")
        if GLOBAL_POOL in self.resource_pools:
            problems.append(
                f"{prefix}.resource_pools.{GLOBAL_POOL} is the trainer's own pool "
                f"({prefix}.nnodes × {prefix}.n_gpus_per_node): name the others differently"
            )
        known = [GLOBAL_POOL, *self.resource_pools]
        for role in ("critic", "reward_model", "rollout"):
            name = getattr(self.role_pool, role)
            if name is not None and name not in known:
                problems.append(f"{prefix}.role_pool.{role}={name!r} names no pool; known: {known}")
        if self.role_pool.rollout == GLOBAL_POOL:
            problems.append(
                f"{prefix}.role_pool.rollout={GLOBAL_POOL}: engines on the actor's devices are "
                "rollout.mode=colocated (leave role_pool.rollout null)"
            )
        return problems


@dataclass
class TrainerConfig:
    project_name: str = "rltrain"
    """Groups runs (the run directory is ``default_local_dir/project_name/experiment_name``)."""

    experiment_name: str = "run"
    """Name of this run."""

    default_local_dir: str = "runs"
    """Root of run directories (resolved config, metrics, TensorBoard, checkpoints)."""

    total_training_steps: int | None = None
    """PPO steps to run; null means ``total_epochs`` over the training prompts."""

    total_epochs: int = 1
    """Epochs over the training prompts when ``total_training_steps`` is null."""

    save_freq: int = -1
    """Save a checkpoint every this many steps (and at the end); -1 saves only at the end, 0 never."""

    test_freq: int = -1
    """Evaluate every this many steps (and at the end); -1 only at the end, 0 never."""

    val_before_train: bool = False
    """Evaluate once before the first step."""

    resume_mode: Literal["auto", "disable", "resume_path"] = "auto"
    """``auto`` continues from the newest complete checkpoint of the run directory if there is one."""

    resume_from_path: str | None = None
    """Checkpoint directory to resume from with ``resume_mode: resume_path``."""

    seed: int = 42
    """Seed of everything not seeded elsewhere (model init, dropout, sampling order)."""

    logger: list[Literal["console", "tensorboard", "jsonl", "wandb"]] = field(
        default_factory=lambda: ["console", "tensorboard", "jsonl"]
    )
    """Metric sinks (:mod:`rltrain.logging.tracker`): the console line, ``tensorboard/`` and
    ``metrics.jsonl`` in the run directory, and ``wandb`` (a Weights & Biases run of ``project_name``
    named ``experiment_name``, its files in ``<run dir>/wandb/``; needs the optional package:
    ``pip install 'rltrain[wandb]'``; see ``wandb_mode``)."""

    wandb_mode: Literal["auto", "online", "offline"] = "auto"
    """How the ``wandb`` logger syncs. ``offline`` writes the run to disk only and never touches the
    network (``wandb sync <run dir>/wandb/offline-run-*`` uploads it later); ``online`` streams it to
    the W&B server (a key from ``WANDB_API_KEY`` or ``wandb login``). ``auto``: ``WANDB_MODE`` when
    set, else ``online`` when ``WANDB_API_KEY`` is set, else ``offline``, so a machine without an API
    key in its environment never tries the network."""

    log_samples: bool = True
    """Log a line per sample (its id, finish reason, length, score, advantage) and each rank's
    trained ids per mini-batch into the run's log file (TRACE level; never the console). About 300
    bytes a sample: turn it off for large batches (the ids stay in ``rollout_data_dir``'s dumps)."""

    rollout_data_dir: str | None = None
    """Write each step's training samples to ``<dir>/<step>.jsonl`` (verl's key): a line per sample
    with its id, prompt and response text, ground truth, data source, score, reward, mean advantage,
    response length and finish reason (:mod:`rltrain.logging.samples`). null: no dump."""

    validation_data_dir: str | None = None
    """Write each validation's samples to ``<dir>/<step>.jsonl`` (verl's key; step 0 before
    training), with their score and correctness. null: no dump."""

    verbose: bool = False
    """Also show the logs of Ray, vLLM, Megatron and other libraries on the console (``rltrain train
    --verbose``); they always go to ``rltrain.log`` in the run directory."""

    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """What checkpoints hold and how many are kept."""

    timeouts: TimeoutConfig = field(default_factory=TimeoutConfig)
    """How long each call to the workers and each collective may take before the run stops."""

    max_restarts: NonNegativeInt = 0
    """Restarts after a worker process died or stopped answering (a ``trainer.timeouts`` bound): every
    worker group is started again and the run resumes from its last good checkpoint (step 0 when it
    has none yet), logging ``trainer/restarts`` and ``trainer/recover_seconds``. 0 stops the run at
    the first such failure, naming the role and rank. Ray mode only (under torchrun, torchrun's own
    ``--max-restarts`` restarts every rank and ``resume_mode: auto`` continues from the checkpoint)."""

    pipeline: Literal["sync", "one_step_off", "fully_async"] = "sync"
    """How generation and training overlap (:mod:`rltrain.trainer.pipeline`). ``sync``: each
    step generates its batch with the weights of the step before, then trains. ``one_step_off``:
    the engines generate batch k+1 while the trainer trains on batch k (samples one policy version
    old; deterministic). ``fully_async``: the engines run up to ``max_staleness`` batches ahead and
    take new weights whenever they are between batches, so no side waits for the other while the
    bound allows (which version a batch gets depends on timing). Both need engines on devices of
    their own (``rollout.mode: separate``) and the Ray mode."""

    overlap_critic: bool | None = None
    """Run the critic's calls (values, update) while the actor's run (old and reference log-probs,
    update, weight sync) instead of after them: the step waits only for the longer of the two. The
    results are the same either way (the roles are separate processes); ``timing_s/values`` and
    ``timing_s/update_critic`` then count only the time the driver spent starting the critic's call
    and still waiting for it. null: on where the two do not compete for a device: on a CPU-only
    cluster (each role's process computes on its own cores) or with the critic on a resource pool of
    its own (``cluster.role_pool.critic``); off where they share GPUs (both models' activations would
    be resident at once). The torchrun mode hosts both roles in one process and always runs them one
    after the other."""

    max_staleness: NonNegativeInt = 1
    """``pipeline: fully_async``: how many policy versions a sample may lag the weights it trains
    (a batch generated with the weights after step v trains at step t with staleness t-1-v); 0 is
    the ``sync`` schedule on separate engines. ``one_step_off`` is 1."""

    max_consecutive_skipped_steps: PositiveInt = 3
    """Stop the run, naming the role and the first non-finite value, once a role has skipped this many
    optimizer steps in a row for a non-finite loss or gradient (one skipped now and then is tolerated:
    the step leaves the parameters unchanged)."""

    max_param_abs: PositiveFloat | None = 1.0e4
    """Stop the run when a parameter's magnitude exceeds this after an optimizer step (weights blown
    up by too large a learning rate stay finite for a while, then make every later step non-finite);
    null disables the check. Parameters that are not finite after a step always stop the run."""

    def validate(self, prefix: str) -> list[str]:
        problems = []
        if self.total_training_steps is not None and self.total_training_steps < 1:
            problems.append(f"{prefix}.total_training_steps must be >= 1, got {self.total_training_steps}")
        if self.total_epochs < 1:
            problems.append(f"{prefix}.total_epochs must be >= 1, got {self.total_epochs}")
        if self.save_freq < -1 or self.test_freq < -1:
            problems.append(f"{prefix}.save_freq and {prefix}.test_freq must be >= -1")
        if self.resume_mode == "resume_path" and not self.resume_from_path:
            problems.append(f"{prefix}.resume_mode=resume_path needs {prefix}.resume_from_path")
        if self.checkpoint.max_ckpt_to_keep is not None and self.checkpoint.max_ckpt_to_keep < 1:
            problems.append(f"{prefix}.checkpoint.max_ckpt_to_keep must be >= 1 or null")
        if self.pipeline == "one_step_off" and self.max_staleness != 1:
            problems.append(
                f"{prefix}.pipeline=one_step_off trains on samples exactly one version old; "
                f"{prefix}.max_staleness={self.max_staleness} is for {prefix}.pipeline=fully_async"
            )
        for key in ("rollout_data_dir", "validation_data_dir"):
            if getattr(self, key) == "":
                problems.append(f"{prefix}.{key} must be a directory or null, got ''")
        if "wandb" in self.logger:
            missing = optional_package_problem("wandb")
            if missing:
                problems.append(f"{prefix}.logger includes wandb, but {missing}: pip install '{WANDB}'")
        if self.checkpoint.discard_existing and self.resume_mode != "disable":
            problems.append(
                f"{prefix}.checkpoint.discard_existing=true needs {prefix}.resume_mode=disable "
                f"(got {self.resume_mode!r}): it deletes the checkpoints a resume would continue from"
            )
        return problems


def optional_package_problem(package: str) -> str | None:
    """Why the optional ``package`` (:data:`rltrain.requirements.OPTIONAL`) cannot serve, or None when
    an installed version satisfies the release's requirement."""
    from importlib.metadata import PackageNotFoundError, version

    from packaging.specifiers import SpecifierSet

    spec = OPTIONAL[package]
    try:
        found = version(package)
    except PackageNotFoundError:
        return f"the {package} package is not installed"
    if not SpecifierSet(spec).contains(found, prereleases=True):
        return f"{package} {found} is installed, this release needs {package}{spec}"
    return None
