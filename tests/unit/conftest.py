"""Fixtures shared by the unit tests."""

from __future__ import annotations

import pytest
import torch.distributed as dist


@pytest.fixture
def gloo_world_of_one(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield
    dist.destroy_process_group()
