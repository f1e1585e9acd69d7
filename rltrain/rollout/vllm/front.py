"""``EngineFront``: what both vLLM engines expose of the parts they hold, an ``EngineCore``
(``core``), a ``WeightReceiver`` (``weights``) and the ``EngineCalls`` of the running engine
(``calls``): the protocol's settings, tokenizer, sleep / wake, weight receive, digests and
prefix-cache reset. Each engine class then holds only its start, its generation and its shutdown;
neither inherits the other.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from rltrain.rollout.protocol import EngineSettings
from rltrain.rollout.vllm.core import EngineCalls, EngineCore
from rltrain.rollout.vllm.receive import WeightReceiver
from rltrain.weight_sync.sampling import DigestRequest
from rltrain.weight_sync.types import NamedTensor, SyncStats, TensorRegions


class EngineFront:
    """Delegates to ``core``, ``weights`` and ``calls`` (set by the engine's ``__init__``)."""

    core: EngineCore
    weights: WeightReceiver
    calls: EngineCalls

    @property
    def settings(self) -> EngineSettings:
        return self.core.settings

    @property
    def model_path(self) -> str:
        return self.core.model_path

    @property
    def in_process(self) -> bool:
        return self.core.in_process

    @property
    def tokenizer(self) -> Any:
        return self.core.tokenizer

    @property
    def asleep(self) -> bool:
        """Whether ``sleep`` released memory that ``wake_up`` has not restored yet."""
        return self.core.asleep

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of ``messages`` with the tokenizer's chat template and the assistant turn opened."""
        return self.core.apply_chat_template(messages)

    def sleep(self, level: int = 1) -> None:
        """Release the KV cache (level 1: offload weights to host; level 2: drop them too)."""
        self.core.sleep(self.calls, level)

    def wake_up(self) -> None:
        """Restore what ``sleep`` released (a ``load_weights`` meanwhile already woke the weights)."""
        self.core.wake_up(self.calls)

    @property
    def num_workers(self) -> int:
        """The engine's TP workers (what ``TensorRegions.regions`` is keyed by)."""
        return self.weights.num_workers

    def load_weights(
        self, named_tensors: Iterable[NamedTensor], *, bucket_bytes: int = 256 << 20
    ) -> SyncStats:
        """``WeightReceiver.load_weights``."""
        return self.weights.load_weights(named_tensors, bucket_bytes=bucket_bytes)

    def receive(self, updates: Iterable[TensorRegions], *, bucket_bytes: int = 256 << 20) -> SyncStats:
        """``WeightReceiver.receive``."""
        return self.weights.receive(updates, bucket_bytes=bucket_bytes)

    def weights_digests(self) -> dict[str, str]:
        return self.weights.weights_digests()

    def all_weights_digests(self, request: DigestRequest | None = None) -> list[dict[str, str]]:
        return self.weights.all_weights_digests(request)

    def reset_prefix_cache(self) -> None:
        self.calls.reset_prefix_cache()
