"""Which device weight transfers use: both ends of a send/recv must derive the same one."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_bridge import live


def test_comm_device_is_cpu_under_gloo(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        assert live.comm_device() == torch.device("cpu")
        # a shard moved to itself comes back as a copy on that device, not a view of the parameter
        param = torch.arange(6.0).reshape(2, 3)
        moved = live._transfer(param, src=0, dst=0, me=0)
        assert torch.equal(moved, param) and moved.data_ptr() != param.data_ptr()
    finally:
        dist.destroy_process_group()


def test_comm_device_is_the_current_cuda_device_under_nccl_gpu_double(monkeypatch):
    """GPU double (no GPU here): NCCL moves CUDA tensors only, so under an NCCL default group (alone
    or mixed with gloo for CPU tensors) the transfers run on the current CUDA device."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    for backend in ("nccl", "cpu:gloo,cuda:nccl"):
        monkeypatch.setattr(dist, "get_backend", lambda group=None, b=backend: b)
        assert live.comm_device() == torch.device("cuda", 3)
