"""The vLLM engines keep the engine protocol (``rltrain.rollout.protocol``): every member that
callers use is there, methods with the protocol's parameters, read from the classes (no engine is
started)."""

from __future__ import annotations

import inspect
from typing import Protocol

import pytest

from rltrain.rollout.protocol import AsyncRolloutEngine, RolloutEngine
from rltrain.rollout.vllm.async_engine import AsyncVllmEngine
from rltrain.rollout.vllm.engine import VllmEngine


def members(protocol: type) -> dict[str, object]:
    """The protocol's own members (annotated attributes as None, methods and properties as such)."""
    found: dict[str, object] = {}
    for cls in reversed(protocol.__mro__):
        if cls in (object, Protocol) or Protocol not in cls.__mro__[1:]:
            continue
        found.update({name: None for name in inspect.get_annotations(cls)})
        found.update({n: v for n, v in cls.__dict__.items() if not n.startswith("_")})
    return found


def parameters(function: object) -> list[tuple[str, object]]:
    return [(p.name, p.kind) for p in inspect.signature(function).parameters.values()]


def test_the_protocols_name_what_callers_use():
    assert set(members(RolloutEngine)) == {
        "settings", "tokenizer", "num_workers", "asleep", "generate", "receive", "load_weights",
        "weights_digests", "all_weights_digests", "sleep", "wake_up", "reset_prefix_cache", "shutdown",
    }  # fmt: skip
    assert set(members(AsyncRolloutEngine)) - set(members(RolloutEngine)) == {
        "loop", "partial_rollout", "policy_version", "run", "agenerate", "agenerate_versioned",
        "start_batch", "weight_update",
    }  # fmt: skip


@pytest.mark.parametrize(
    ("engine", "protocol"), [(VllmEngine, RolloutEngine), (AsyncVllmEngine, AsyncRolloutEngine)]
)
def test_the_vllm_engines_have_every_member_of_their_protocol(engine, protocol):
    for name, member in members(protocol).items():
        assert hasattr(engine, name), f"{engine.__name__} lacks {name}"
        if inspect.isfunction(member):
            assert parameters(getattr(engine, name)) == parameters(member), f"{engine.__name__}.{name}"
        if isinstance(member, property):
            assert isinstance(inspect.getattr_static(engine, name), property), f"{engine.__name__}.{name}"
