"""Model converters: transformations of the built Megatron model (LoRA adapters, quantization) and
what each tells the optimizer, the checkpoint and the weight export.

Contract: ``build_model(..., converters=[...])`` runs :func:`apply_converters` on every chunk as soon
as it is built (on its device, before Megatron's DDP and the optimizer see it). For each converter,
in list order:

1. ``convert(chunk)`` changes the bare ``GPTModel`` chunk in place: wraps modules, adds its own
   parameters. It must keep the names of the parameters it does not own (the weight bridge maps
   them to the HF checkpoint by name).
2. ``owned_parameters(chunk)`` names the parameters it added. They are none of the HF checkpoint's:
   they get the ``megatron_bridge.live.NOT_MAPPED`` attribute, so the bridge neither loads, plans
   nor exports them.
3. ``trainable(name)`` for every parameter of the chunk: ``False`` freezes it (``requires_grad``
   off: Megatron's DDP gives it no gradient buffer and the optimizer neither a group entry nor
   state), ``True`` makes it trainable, ``None`` leaves what an earlier converter decided (at first:
   every parameter trainable).

Later, through :class:`~rltrain.megatron.worker.MegatronWorker`:

4. ``in_checkpoint(key)`` for every key of a chunk's (sharded) state dict: whether the model's
   checkpoint holds it (:func:`checkpoint_filter`: a key goes in when every converter says so). A
   load then expects exactly the kept keys. A converter must keep every trainable parameter (the
   optimizer's state refers to them).
5. ``export(chunk, tensors)`` at every weight sync (``rltrain.weight_sync.PlannedExport``): what the
   rollout engine receives from one chunk, as ``{Megatron local name: tensor}`` of the tensors the
   bridge maps (this rank's TP shards), returned in the same form: merge adapters into the base
   weights, rename. Runs without autograd; must not change the model.

With no converters, nothing here runs: the model, the optimizer's groups, the checkpoint and the
export are what they were before this seam existed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch

from megatron_bridge.live import NOT_MAPPED


class ModelConverter:
    """The base of a model converter: converts nothing, owns nothing, keeps every decision
    (module docstring). Subclasses override what they change."""

    name = "converter"
    """Named in errors."""

    def convert(self, chunk: torch.nn.Module) -> None:
        """Wrap or change modules of the bare ``GPTModel`` ``chunk`` in place."""

    def owned_parameters(self, chunk: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """(name in ``chunk``, parameter) of each parameter this converter added to ``chunk``."""
        return iter(())

    def trainable(self, name: str) -> bool | None:
        """Whether the optimizer trains parameter ``name`` of a chunk; None: no opinion."""
        return None

    def in_checkpoint(self, key: str) -> bool:
        """Whether the model checkpoint holds ``key`` of a chunk's state dict."""
        return True

    def export(self, chunk: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """What the weight export sends of ``chunk``: ``tensors`` (Megatron local names) transformed."""
        return tensors


def apply_converters(chunk: torch.nn.Module, converters: Sequence[ModelConverter]) -> None:
    """Convert ``chunk`` in place, mark the converters' own parameters unmapped, then set each
    parameter's ``requires_grad`` by the converters' ``trainable`` (a later converter wins)."""
    for converter in converters:
        converter.convert(chunk)
        for name, param in converter.owned_parameters(chunk):
            if not isinstance(param, torch.nn.Parameter):
                raise TypeError(f"{converter.name}: owned parameter {name!r} is not an nn.Parameter")
            setattr(param, NOT_MAPPED, True)
    for name, param in chunk.named_parameters():
        for converter in converters:
            decided = converter.trainable(name)
            if decided is not None:
                param.requires_grad_(decided)


def checkpoint_filter(converters: Sequence[ModelConverter]) -> Callable[[str], bool] | None:
    """The chunks' state-dict keys the model checkpoint holds (every converter agrees); None
    without converters (the checkpoint holds everything, loaded strictly)."""
    if not converters:
        return None
    return lambda key: all(c.in_checkpoint(key) for c in converters)
