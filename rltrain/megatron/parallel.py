"""Parallel context of one Megatron role: torch.distributed plus Megatron's process groups.

Contract: ``ParallelContext.initialize(parallel, seed=...)`` starts torch.distributed from the
usual launcher environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, optional
``LOCAL_RANK``) with NCCL on GPU and gloo on CPU, builds Megatron's TP/PP/VPP/CP/EP/expert-TP/DP
groups from a ``ParallelConfig``, seeds Megatron's RNG tracker, and returns one object that is
passed explicitly to everything else. Megatron keeps its groups in ``parallel_state`` module
globals; this object is the only code of ours that touches them (``destroy()`` clears them).
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from megatron.core import tensor_parallel
from megatron.core.process_groups_config import ProcessGroupCollection

from rltrain.config.parallel import ParallelConfig
from rltrain.megatron.cpu_compat import apply_cpu_compat


@dataclass
class ParallelContext:
    """Ranks, sizes and groups of this process; built by ``initialize``."""

    parallel: ParallelConfig
    """The layout this context was built from."""
    device: torch.device
    """``cuda:<local_rank>`` on GPU, ``cpu`` otherwise."""
    rank: int
    world_size: int
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    vpp_size: int | None
    cp_rank: int
    """Rank in the context-parallel group (which chunks of each sequence this rank holds)."""
    cp_size: int
    dp_rank: int
    """Rank among the data-parallel replicas (CP ranks of one replica share it and its batch)."""
    dp_size: int
    dp_cp_rank: int
    """Rank in the DP×CP group: distinct for every rank holding the same TP/PP shard of the dense
    weights (the copy a checkpoint or the weight sync reads is the one with 0)."""
    ep_rank: int
    ep_size: int
    etp_rank: int
    """Rank in the expert tensor-parallel group (splits each expert; equal to ``tp_rank`` when expert-TP = TP)."""
    etp_size: int
    expert_dp_rank: int
    """Rank among the replicas of this rank's experts (ranks with equal PP, TP and EP ranks)."""
    groups: ProcessGroupCollection
    """Megatron's groups: ``tp``, ``pp``, ``cp``, ``dp``, ``dp_cp``, ``ep``, ``expt_tp``, ``mp``, ..."""
    owns_process_group: bool
    """Whether ``initialize`` started torch.distributed (and ``destroy`` should end it)."""

    @classmethod
    def initialize(
        cls, parallel: ParallelConfig, *, seed: int = 1234, timeout_minutes: float = 30
    ) -> ParallelContext:
        """Start (or reuse) torch.distributed and build Megatron's groups for ``parallel``; a rank
        waits at most ``timeout_minutes`` in one of their collectives."""
        apply_cpu_compat()
        owns = not dist.is_initialized()
        if owns:
            use_cuda = torch.cuda.is_available()
            if use_cuda:
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group(
                backend="nccl" if use_cuda else "gloo", timeout=timedelta(minutes=timeout_minutes)
            )
        world_size = dist.get_world_size()
        problems = parallel.validate("parallel", world_size)
        if problems:
            raise ValueError("; ".join(problems))
        if mpu.model_parallel_is_initialized():
            raise RuntimeError(
                "Megatron's parallel state is already initialized; destroy() the other context"
            )
        mpu.initialize_model_parallel(
            tensor_model_parallel_size=parallel.tensor_model_parallel_size,
            pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size=parallel.virtual_pipeline_model_parallel_size,
            context_parallel_size=parallel.context_parallel_size,
            expert_model_parallel_size=parallel.expert_model_parallel_size,
            expert_tensor_parallel_size=parallel.expert_tensor_parallel_size,
            distributed_timeout_minutes=timeout_minutes,
        )
        seed_everything(seed)
        device = (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
        return cls(
            parallel=parallel,
            device=device,
            rank=dist.get_rank(),
            world_size=world_size,
            tp_rank=mpu.get_tensor_model_parallel_rank(),
            tp_size=mpu.get_tensor_model_parallel_world_size(),
            pp_rank=mpu.get_pipeline_model_parallel_rank(),
            pp_size=mpu.get_pipeline_model_parallel_world_size(),
            vpp_size=parallel.virtual_pipeline_model_parallel_size,
            cp_rank=mpu.get_context_parallel_rank(),
            cp_size=mpu.get_context_parallel_world_size(),
            dp_rank=mpu.get_data_parallel_rank(),
            dp_size=mpu.get_data_parallel_world_size(),
            dp_cp_rank=mpu.get_data_parallel_rank(with_context_parallel=True),
            ep_rank=mpu.get_expert_model_parallel_rank(),
            ep_size=mpu.get_expert_model_parallel_world_size(),
            etp_rank=mpu.get_expert_tensor_parallel_rank(),
            etp_size=mpu.get_expert_tensor_parallel_world_size(),
            expert_dp_rank=mpu.get_expert_data_parallel_rank(),
            groups=ProcessGroupCollection.use_mpu_process_groups(),
            owns_process_group=owns,
        )

    @property
    def is_pipeline_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_pipeline_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def pipeline_last_rank(self) -> int:
        """Global rank of the last pipeline stage in this rank's pipeline group."""
        return mpu.get_pipeline_model_parallel_last_rank()

    def destroy(self) -> None:
        """Clear Megatron's groups, and end torch.distributed if this context started it."""
        mpu.destroy_model_parallel()
        if self.owns_process_group and dist.is_initialized():
            dist.destroy_process_group()


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy, torch and Megatron's tracker (TP/EP-rank-dependent streams)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def last_stage_layers_for_megatron(parallel: ParallelConfig) -> int | None:
    """``num_layers_in_last_pipeline_stage`` as Megatron-Core is told it. With virtual stages and both
    counts set at PP=2 (no middle stage) Megatron-Core 0.16's layer offset divides by the number of
    middle stages (ZeroDivisionError); there the last stage's count is implied by the first's, so it
    is left out (the same split: 6 layers 2 + 4 at PP=2 × VPP=2 trains like one stage)."""
    last = parallel.num_layers_in_last_pipeline_stage
    both = parallel.num_layers_in_first_pipeline_stage is not None and last is not None
    if both and parallel.virtual_pipeline_model_parallel_size and parallel.pipeline_model_parallel_size == 2:
        return None
    return last
