"""Driver-side run preparation and the run itself: resolve the model, load the tokenizer and the
prompts (before any worker starts, so that bad input stops the run in one line), then drive
:class:`~rltrain.trainer.driver.PPOTrainer` over the roles a launcher started, with restarts
(:mod:`~rltrain.trainer.recovery`) and preemption. No Ray here: the Ray launcher
(:mod:`~rltrain.orchestrator.entry`) and the torchrun mode (:mod:`~rltrain.orchestrator.spmd`) both
call :func:`prepare_run` and :func:`run_driver`.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from rltrain.config import RLConfig, write_resolved
from rltrain.data.dataset import PromptDataset
from rltrain.data.loader import PromptLoader
from rltrain.data.prompt_rows import PromptFields
from rltrain.logging.console import stage, terminal

log = logging.getLogger(__name__)


@dataclass
class RunData:
    train: PromptLoader
    """Training prompt batches (resumable)."""

    val: PromptDataset | None
    """Held-out prompts for evaluation, if any."""

    num_filtered: int
    """Prompts dropped for exceeding ``data.max_prompt_length`` (train + val)."""


def tool_schemas(config: RLConfig) -> list[dict] | None:
    """The function schemas of a multi-turn run's tools (what the chat template renders), or None.

    Reads the tools and interaction files here, before any worker starts, so that a bad one stops
    the run with a one-line error naming the file and key."""
    multi_turn = config.rollout.multi_turn
    if not multi_turn.enable:
        return None
    from rltrain.agent.interactions import load_interaction
    from rltrain.agent.tools.registry import load_tool_config

    if multi_turn.interaction_config_path:
        load_interaction(multi_turn.interaction_config_path)
    if not multi_turn.tool_config_path:
        return None
    return load_tool_config(multi_turn.tool_config_path).schemas()


def build_data(config: RLConfig, tokenizer) -> RunData:
    data = config.data
    common = dict(
        max_prompt_length=data.max_prompt_length,
        apply_chat_template=data.apply_chat_template,
        tools=tool_schemas(config),
    )
    fields = PromptFields(prompt_key=data.prompt_key, answer_key=data.answer_key)
    if data.generated is not None:
        from rltrain.data.tasks import arithmetic_splits

        task = data.generated
        train_rows, val_rows = arithmetic_splits(
            num_train=task.num_train,
            num_val=task.num_val,
            seed=task.seed,
            max_operand=task.max_operand,
            ops=task.ops,
            task=task.name,
        )
        train = PromptDataset.from_rows(
            train_rows, tokenizer, name=f"generated:{task.name}/train", fields=fields, **common
        )
        val = (
            PromptDataset.from_rows(
                val_rows, tokenizer, name=f"generated:{task.name}/val", fields=fields, **common
            )
            if val_rows
            else None
        )
    else:
        train = PromptDataset.load(data.train_files, tokenizer, fields=fields, **common)
        val = (
            PromptDataset.load(data.val_files, tokenizer, fields=fields, **common) if data.val_files else None
        )
    from rltrain.rewards import RewardManager

    RewardManager.from_config(config.reward).check_examples([*train, *(val or [])])
    batch_size = data.gen_batch_size or data.train_batch_size  # dynamic sampling draws gen_batch_size a round
    loader = PromptLoader(train, batch_size, seed=data.seed, shuffle=data.shuffle)
    return RunData(train=loader, val=val, num_filtered=train.num_filtered + (val.num_filtered if val else 0))


def total_steps_of(config: RLConfig, data: RunData) -> int:
    return config.trainer.total_training_steps or config.trainer.total_epochs * len(data.train)


@dataclass
class RunSetup:
    model_dir: str
    """HF directory every role starts from."""

    tokenizer: object
    """The model's tokenizer (decodes responses for the rewards)."""

    data: RunData
    """Prompts."""

    total_steps: int
    """PPO steps of the whole run."""


def prepare_run(config: RLConfig, *, write_config: bool = True) -> RunSetup:
    """Resolve the model, load the tokenizer and the prompts; write the resolved config."""
    if write_config:
        write_resolved(config, config.run_dir())
    tiny = config.model.tiny
    warmup = (
        f" (on first use: a {tiny.sft_warmup_steps}-step SFT warm-up of the tiny model)"
        if tiny and tiny.sft_warmup_steps
        else ""
    )
    with stage(f"preparing the model and the prompts{warmup}"):
        from transformers import AutoTokenizer

        from rltrain.models.source import resolve_model_dir

        model_dir = str(
            resolve_model_dir(
                config.model, data=config.data, tools_file=config.rollout.multi_turn.tool_config_path
            )
        )
        check_context_length(config, model_dir)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        check_reward_model_tokenizer(config, tokenizer)
        data = build_data(config, tokenizer)
    return RunSetup(
        model_dir=model_dir, tokenizer=tokenizer, data=data, total_steps=total_steps_of(config, data)
    )


CONTEXT_STATED_ROPE = ("su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling")
"""RoPE types whose configs state the extended context in ``max_position_embeddings``; any other
type's ``factor`` multiplies it (vLLM's ``_get_and_verify_max_len``: linear and dynamic scaling)."""


def check_context_length(config: RLConfig, model_dir: str) -> None:
    """Refuse prompts plus responses (or ``rollout.max_model_len``) longer than the model's context,
    ``max_position_embeddings`` of its ``config.json`` (times a linear or dynamic RoPE factor, as vLLM
    derives it), in one line naming the keys; vLLM refused them inside an engine process. A config
    that states no context is not checked."""
    from rltrain.errors import RunStopped

    path = Path(model_dir) / "config.json"
    hf = json.loads(path.read_text())
    hf = hf.get("text_config") or hf
    context = hf.get("max_position_embeddings")
    if not context:
        return
    rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    if rope.get("rope_type", rope.get("type")) not in CONTEXT_STATED_ROPE and rope.get("factor"):
        context = int(context * rope["factor"])
    if config.rollout.max_model_len:
        key, longest = "rollout.max_model_len", config.rollout.max_model_len
    else:
        key = "data.max_prompt_length + rollout.response_length"
        longest = config.data.max_prompt_length + config.rollout.response_length
    if longest > context:
        raise RunStopped(
            f"{key} = {longest} exceeds the model's context of {context} tokens (max_position_embeddings "
            f"in {path}); vLLM refuses a longer max_model_len"
        )


def check_reward_model_tokenizer(config: RLConfig, tokenizer) -> None:
    """The reward model reads the policy's token ids: refuse one whose tokenizer (in its
    ``reward.reward_model.model.path``) maps tokens differently, or that has none, naming the dir."""
    rm = config.reward.reward_model
    if not rm.enable:
        return
    from rltrain.errors import RunStopped

    path = rm.model.path
    try:
        from transformers import AutoTokenizer

        theirs = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as err:
        raise RunStopped(
            f"reward.reward_model.model.path={path}: no tokenizer could be loaded there ({type(err).__name__}); "
            "the reward model reads the policy's token ids and must ship the policy's tokenizer"
        ) from None
    if theirs.get_vocab() != tokenizer.get_vocab():
        raise RunStopped(
            f"reward.reward_model.model.path={path}: its tokenizer ({len(theirs)} tokens) differs from the "
            f"policy's ({len(tokenizer)} tokens); the reward model reads the policy's token ids"
        )


def run_driver(
    config: RLConfig,
    setup: RunSetup,
    roles,
    *,
    checkpoints=None,
    is_logger: bool = True,
    rewards=None,
    stop=None,
    restart_roles=None,
) -> int:
    """Run the PPO loop over ``roles`` (or those a call of ``roles`` starts); only ``is_logger``
    writes metrics and shows progress.

    ``rewards``: what scores the responses (the Ray launcher passes a pool of Ray CPU tasks when
    ``reward.num_workers`` > 0); by default the config's reward manager, in the driver. ``stop``: the run's
    :class:`~rltrain.trainer.preemption.StopSignals`; a stop they asked for before the last
    step raises :class:`~rltrain.trainer.preemption.Preempted` once the step is saved.
    ``restart_roles``: kills the roles' workers and returns new roles over new ones; with
    ``trainer.max_restarts`` > 0 a worker that dies or stops answering goes through it
    (:mod:`~rltrain.trainer.recovery`)."""
    from rltrain.logging import metrics as mk
    from rltrain.logging.progress import StepProgress
    from rltrain.logging.tracker import MetricsLogger
    from rltrain.logging.wandb_run import WandbOptions
    from rltrain.rewards import RewardManager
    from rltrain.trainer.checkpoints import RunCheckpoints
    from rltrain.trainer.driver import PPOTrainer
    from rltrain.trainer.recovery import RestartMetrics, WorkerLost, fit_with_restarts

    max_restarts = config.trainer.max_restarts if restart_roles is not None else 0
    try:
        started = roles() if callable(roles) else roles
    except WorkerLost as err:  # lost while the workers started: a restart's business too
        if not max_restarts:
            raise
        started = err
    backends = config.trainer.logger if is_logger else ()
    term = terminal()
    tracker = MetricsLogger(
        config.run_dir(),
        backends=backends,
        total_steps=setup.total_steps,
        console=term.out,
        wandb=WandbOptions.of(config) if "wandb" in backends else None,
    )
    tracker.log({mk.DATA_NUM_FILTERED: float(setup.data.num_filtered)}, step=0)
    rewards = rewards if rewards is not None else RewardManager.from_config(config.reward)
    checkpoints = checkpoints or RunCheckpoints(
        config.run_dir() / "checkpoints", keep=config.trainer.checkpoint.max_ckpt_to_keep
    )
    sink = RestartMetrics(tracker)
    data_start = setup.data.train.state_dict()

    def trainer_over(roles) -> PPOTrainer:
        return PPOTrainer(
            config,
            roles=roles,
            tokenizer=setup.tokenizer,
            data=setup.data,
            rewards=rewards,
            tracker=sink,
            total_steps=setup.total_steps,
            checkpoints=checkpoints,
            stop=stop,
        )

    def restart() -> PPOTrainer:
        setup.data.train.load_state_dict(data_start)  # a run without checkpoint starts over
        return trainer_over(restart_roles())

    try:
        show_bar = is_logger and term.err.isatty()
        with (
            stage(f"training ({setup.total_steps} step{'s' if setup.total_steps > 1 else ''})"),
            StepProgress(setup.total_steps, disable=not show_bar, file=term.err) as progress,
        ):
            last = fit_with_restarts(
                started if isinstance(started, WorkerLost) else trainer_over(started),
                restart=restart,
                max_restarts=max_restarts,
                restart_metrics=sink,
                progress=progress,
            )
    finally:
        tracker.close()
    if last < setup.total_steps and stop is not None and (signal_name := stop.requested()):
        from rltrain.trainer.preemption import Preempted

        raise Preempted(signal_name=signal_name, step=last, checkpoint=checkpoints.newest())
    log.info("run finished at step %d: %s", last, config.run_dir())
    return last
