"""``MegatronWorker``: the surface the orchestrator calls, on every rank, for one role.

    worker = MegatronWorker(hf_config, ctx=ctx, role="actor", optim=optim_config, total_steps=100)
    (the weight bridge loads HF weights into worker.chunks)
    out = worker.compute_log_prob(batch)        # ModelOutput: logprobs, entropy [batch, response_len]
    res = worker.update(batch, loss_fn)         # TrainStepResult: metrics, grad_norm, skipped, lr
    worker.save_checkpoint(root, step=n); worker.load_checkpoint(root)
    for name, tensor in worker.named_parameters(): ...   # local shards for weight sync

The critic (``role="critic"``) has ``compute_values`` instead of ``compute_log_prob``; the reference
(``role="reference"``) has no optimizer. The reward model (``role="reward"``, forward only, no
optimizer) has ``compute_rm_scores``:

    rm = MegatronWorker(hf_config, ctx=ctx, role="reward", batching=batching)
    (the bridge loads an HF ``*ForSequenceClassification`` checkpoint, ``score.weight`` → the head)
    scores = rm.compute_rm_scores(batch)        # [batch] float32, at each row's last real token

Data (``TokenBatch``, ``ModelOutput`` and ``LossFn`` of :mod:`rltrain.algo.token_batch`): every
rank of one data-parallel replica (its TP/PP/CP ranks) must receive the same batch; each
data-parallel rank receives its own share. Forward outputs come back on every rank of the replica.
Under context parallelism each CP rank runs its chunks of every sequence (``forward``'s docstring)
and still returns the whole [batch, response_len] outputs; its weights equal the other CP ranks'.
The loss callable must use global denominators (e.g. the response-token count of the whole
mini-batch over all DP ranks) so that the gradient is the full mini-batch's.

Trainable roles hold their chunks inside Megatron's DDP; ``chunks`` always returns the bare
``GPTModel`` chunks (what the weight bridge maps). ``converters`` (:mod:`rltrain.megatron.converters`:
LoRA adapters, ...) transform the chunks as they are built and decide which parameters the optimizer
trains and which keys the checkpoint holds; the weight export reads ``worker.converters``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from rltrain.algo.token_batch import LossFn, ModelOutput, TokenBatch
from rltrain.config.moe import MoEConfig
from rltrain.config.optim import OptimConfig
from rltrain.megatron.checkpoint import load_checkpoint, save_checkpoint
from rltrain.megatron.converters import ModelConverter, checkpoint_filter
from rltrain.megatron.forward import run_model
from rltrain.megatron.head_outputs import FusedHead
from rltrain.megatron.micro_batches import MicroBatching
from rltrain.megatron.model import build_model
from rltrain.megatron.model_config import SCALAR_HEAD_ROLES, Role
from rltrain.megatron.moe_metrics import RouterStats
from rltrain.megatron.parallel import ParallelContext
from rltrain.megatron.train_step import TrainStepResult, build_optimizer, train_step, wrap_for_training

logger = logging.getLogger(__name__)


class MegatronWorker:
    """Model chunks, optimizer and scheduler of one role on this rank."""

    def __init__(
        self,
        hf_config: Any,
        *,
        ctx: ParallelContext,
        role: Role,
        batching: MicroBatching | None = None,
        forward_batching: MicroBatching | None = None,
        optim: OptimConfig | None = None,
        total_steps: int = 1,
        recompute_activations: bool = False,
        offload_optimizer: bool = False,
        params_dtype: torch.dtype | None = None,
        make_vocab_size_divisible_by: int = 1,
        fused: FusedHead | None = None,
        moe: MoEConfig | None = None,
        router_replay: str = "disabled",
        converters: Sequence[ModelConverter] = (),
        train_mtp: bool = False,
        detach_mtp_inputs: bool = False,
    ) -> None:
        if router_replay not in ("disabled", "R2", "R3"):
            raise ValueError(f"router_replay.mode={router_replay!r}; expected disabled, R2 or R3")
        if router_replay != "disabled" and recompute_activations:
            raise ValueError(
                f"router_replay.mode={router_replay} with recompute_activations: the recomputed forward "
                "would not replay the routes"
            )
        if (
            router_replay != "disabled"
            and not getattr(hf_config, "num_local_experts", None)
            and not getattr(hf_config, "num_experts", None)
        ):
            raise ValueError(
                f"router_replay.mode={router_replay} on {hf_config.model_type}, which has no experts"
            )
        self.router_replay = router_replay
        """MoE routing replay (verl's ``router_replay.mode``): R2 records the actor's routing in its
        first (old-logprob) pass and replays it in the reference and update passes; R3 replays the
        engine's routes (``batch.routed_experts``) in all three."""
        self.ctx = ctx
        self.vocab_size: int = hf_config.vocab_size
        """The real vocabulary; the model's is padded to a multiple of make_vocab_size_divisible_by × TP."""
        self.role = role
        self.batching = batching or MicroBatching()
        """Micro-batches of the update (``ppo_micro_batch_size_per_gpu``)."""
        self._forward_batching = forward_batching
        self.recompute_activations = recompute_activations
        self.fused = fused
        """The fused log-prob head (``model.use_fused_kernels``) of the actor and reference; None: logits."""
        self.converters = tuple(converters)
        """Model converters applied to the chunks as built; the weight export passes them on
        (``rltrain.weight_sync.PlannedExport``)."""
        chunks = build_model(
            hf_config,
            ctx=ctx,
            role=role,
            params_dtype=params_dtype,
            recompute_activations=recompute_activations,
            moe_options=moe,
            converters=self.converters,
            train_mtp=train_mtp,
            detach_mtp_inputs=detach_mtp_inputs,
        )
        self.router_stats = RouterStats(chunks, per_layer=bool(moe and moe.moe_per_layer_logging))
        """Router statistics of each update (``TrainStepResult.moe_metrics``; none for a dense model)."""
        self.optimizer = self.scheduler = None
        if optim is not None:
            if role in ("reference", "reward"):
                raise ValueError(f"role={role!r} is not trained; pass optim=None")
            self.model = wrap_for_training(chunks, use_distributed_optimizer=optim.use_distributed_optimizer)
            self.optimizer, self.scheduler = build_optimizer(
                self.model, optim, total_steps=total_steps, offload_optimizer=offload_optimizer
            )
        else:
            self.model = chunks
        self._parked: list[tuple[torch.UntypedStorage, torch.Tensor]] = []
        """While offloaded: the released device storages and their CPU copies (``park_storages``)."""

    @property
    def forward_batching(self) -> MicroBatching:
        """Micro-batches of the forward-only passes (``compute_log_prob``, ``compute_values``,
        ``compute_rm_scores``: verl's ``log_prob_micro_batch_size_per_gpu`` and
        ``forward_micro_batch_size_per_gpu``); ``batching`` when none was given."""
        return self._forward_batching or self.batching

    @property
    def chunks(self) -> list[torch.nn.Module]:
        """Bare ``GPTModel`` chunks, one per virtual pipeline stage."""
        return [getattr(m, "module", m) for m in self.model]

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Local parameter shards as ``chunk<i>.<name>`` (TP/PP/EP-local, Megatron names)."""
        for i, chunk in enumerate(self.chunks):
            for name, param in chunk.named_parameters():
                yield f"chunk{i}.{name}", param

    def compute_log_prob(self, batch: TokenBatch) -> ModelOutput:
        """Per-response-token log-probabilities and entropy, [batch, response_len] (no grad).

        Routing replay: with ``batch.routed_experts`` set the routers replay them; otherwise under R2
        the actor records its routing into ``routed_experts`` of the result (R3 needs the engine's)."""
        if self.role in SCALAR_HEAD_ROLES:
            raise ValueError(f"compute_log_prob on role={self.role!r}, which has a scalar head, no LM head")
        replay = None
        if self.router_replay != "disabled":
            if batch.routed_experts is not None:
                replay = "replay"
            elif self.router_replay == "R2" and self.role == "actor":
                replay = "record"
            else:
                raise ValueError(
                    f"router_replay.mode={self.router_replay}: role={self.role!r} got a batch without "
                    "routed_experts"
                    + (" (R3 replays the rollout engine's routes)" if self.router_replay == "R3" else "")
                )
        return run_model(
            self.model,
            batch,
            ctx=self.ctx,
            batching=self.forward_batching,
            vocab_size=self.vocab_size,
            fused=self.fused,
            router_replay=replay,
        ).output

    def compute_values(self, batch: TokenBatch) -> torch.Tensor:
        """Critic values, [batch, response_len] (no grad)."""
        if self.role != "critic":
            raise ValueError(f"compute_values on role={self.role!r}; only the critic has a value head")
        return run_model(
            self.model, batch, ctx=self.ctx, batching=self.forward_batching, outputs="values"
        ).output.values

    def compute_rm_scores(self, batch: TokenBatch) -> torch.Tensor:
        """Reward-model scores, [batch] float32 (no grad): the scalar head's output at each row's last
        token with attention mask 1 (the last response token), where an HF sequence classifier pools."""
        if self.role != "reward":
            raise ValueError(f"compute_rm_scores on role={self.role!r}; only role='reward' scores sequences")
        empty = (batch.attention_mask.sum(dim=1) == 0).nonzero().flatten().tolist()
        if empty:
            raise ValueError(f"compute_rm_scores: rows {empty[:10]} have no token (attention_mask all 0)")
        return run_model(
            self.model, batch, ctx=self.ctx, batching=self.forward_batching, outputs="scores"
        ).scores

    def update(self, batch: TokenBatch, loss_fn: LossFn) -> TrainStepResult:
        """One optimizer step on this data-parallel rank's share of the mini-batch (actor: policy loss
        on logprobs/entropy; critic: value loss on values)."""
        if self.optimizer is None:
            raise ValueError(f"role={self.role!r} has no optimizer (constructed with optim=None)")
        replay = self.router_replay != "disabled" and self.role == "actor"
        if replay and batch.routed_experts is None:
            raise ValueError(
                f"router_replay.mode={self.router_replay}: the update batch has no routed_experts"
            )
        return train_step(
            self.model,
            self.optimizer,
            self.scheduler,
            batch,
            ctx=self.ctx,
            batching=self.batching,
            loss_fn=loss_fn,
            critic=self.role == "critic",
            vocab_size=self.vocab_size,
            fused=self.fused,
            router_stats=self.router_stats,
            router_replay=replay,
        )

    def save_checkpoint(self, root: str | Path, *, step: int) -> Path:
        """Write ``root/step_<step>`` atomically (model, optimizer, scheduler, RNG); returns it."""
        return save_checkpoint(
            root,
            step=step,
            ctx=self.ctx,
            chunks=self.chunks,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            keep=checkpoint_filter(self.converters),
        )

    def load_checkpoint(self, root: str | Path, *, load_optimizer: bool = True) -> int | None:
        """Load the checkpoint ``root/latest`` names; returns its step (None if there is none).

        ``load_optimizer=False`` loads the model only (e.g. across an EP change) and refreshes the
        optimizer's main parameters from it.
        """
        step = load_checkpoint(
            root,
            ctx=self.ctx,
            chunks=self.chunks,
            optimizer=self.optimizer if load_optimizer else None,
            scheduler=self.scheduler if load_optimizer else None,
            keep=checkpoint_filter(self.converters),
        )
        if step is not None and self.optimizer is not None and not load_optimizer:
            self.optimizer.reload_model_params()
        return step

    def offload_to_cpu(self) -> None:
        """Free device memory of parameters and grads between phases (GPU only; no-op on CPU).

        Every tensor stays the same object on the same device: its storage is copied to pinned CPU
        memory and resized to zero, and ``reload_to_device`` refills it in place. With the
        distributed optimizer that storage is the flat buffer the DDP parameters are views of;
        without it (Megatron then leaves the buffer's ``param_data`` unset) it is each parameter's
        own. A parameter is never given new ``.data`` on another device: torch then drops its
        gradient accumulator, and with it the hook through which Megatron's DDP adds each gradient
        into ``main_grad``, so every later step would see zero gradients (the optimizer would keep
        moving on its Adam moments alone). The grad buffer is freed either way.
        """
        if self.ctx.device.type == "cpu" or self._parked:
            return
        tensors = []
        for buffer in self._flat_buffers():
            tensors += (
                [buffer.param_data] if buffer.param_data is not None else [p.data for p in buffer.params]
            )
        tensors += [p.data for p in self._unbuffered_params()]
        self._parked = park_storages(tensors)
        for buffer in self._flat_buffers():
            buffer.grad_data.untyped_storage().resize_(0)

    def reload_to_device(self) -> None:
        """Inverse of ``offload_to_cpu``; gradients come back zeroed."""
        if self.ctx.device.type == "cpu":
            return
        for buffer in self._flat_buffers():
            grad = buffer.grad_data
            grad.untyped_storage().resize_(grad.numel() * grad.element_size())
            grad.zero_()
        unpark_storages(self._parked)
        self._parked = []

    def _flat_buffers(self) -> list[Any]:
        """The param/grad buffers of Megatron's DDP wrappers (a reference's bare chunks have none:
        ``nn.Module.buffers`` is a method, not Megatron's list)."""
        out = []
        for m in self.model:
            for name in ("buffers", "expert_parallel_buffers"):
                found = getattr(m, name, None)
                if isinstance(found, list):
                    out += found
        return out

    def _unbuffered_params(self) -> list[torch.nn.Parameter]:
        return [] if self.optimizer is not None else [p for c in self.chunks for p in c.parameters()]


def park_storages(tensors: list[torch.Tensor]) -> list[tuple[torch.UntypedStorage, torch.Tensor]]:
    """Copy the storage under each tensor to CPU memory (pinned when it is on CUDA) and release it:
    the tensors stay the same objects, of the same device, dtype and shape, so autograd's gradient
    accumulators and the hooks on them survive. A storage shared by several tensors (tied weights,
    views of one flat buffer) is copied once. Returns what ``unpark_storages`` restores."""
    parked, seen = [], set()
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        saved = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=storage.device.type == "cuda")
        saved.copy_(_bytes_of(storage))  # synchronous: done before the storage is released
        parked.append((storage, saved))
    for storage, _ in parked:
        storage.resize_(0)
    return parked


def unpark_storages(parked: list[tuple[torch.UntypedStorage, torch.Tensor]]) -> None:
    """Give each released storage its bytes back, in place (the inverse of ``park_storages``)."""
    for storage, saved in parked:
        storage.resize_(saved.numel())
        _bytes_of(storage).copy_(saved, non_blocking=True)
    if any(storage.device.type == "cuda" for storage, _ in parked):
        torch.cuda.current_stream().synchronize()  # before the caller drops the pinned copies


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A flat uint8 tensor over all of ``storage`` (any dtype, any device)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
