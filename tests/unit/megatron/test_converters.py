"""``apply_converters`` and ``checkpoint_filter`` on a plain torch module: ownership marks, the
trainable decision (a later converter wins, None keeps), and which keys a checkpoint holds."""

from __future__ import annotations

import torch

from megatron_bridge.live import NOT_MAPPED, mapped_tensors
from rltrain.megatron.converters import ModelConverter, apply_converters, checkpoint_filter


class _AddsScale(ModelConverter):
    """Adds ``scale`` [1] to the model, trains only it, keeps only it in the checkpoint."""

    def convert(self, chunk: torch.nn.Module) -> None:
        chunk.scale = torch.nn.Parameter(torch.ones(1))

    def owned_parameters(self, chunk: torch.nn.Module):
        return iter([("scale", chunk.scale)])

    def trainable(self, name: str) -> bool | None:
        return name == "scale"

    def in_checkpoint(self, key: str) -> bool:
        return key == "scale"


class _TrainsBias(ModelConverter):
    """No opinion but on ``bias``, which it trains."""

    def trainable(self, name: str) -> bool | None:
        return True if name == "bias" else None


def _model() -> torch.nn.Module:
    return torch.nn.Linear(3, 2)


def test_no_converters_change_nothing() -> None:
    model = _model()
    apply_converters(model, [])
    assert [(n, p.requires_grad) for n, p in model.named_parameters()] == [("weight", True), ("bias", True)]
    assert [n for n, _ in mapped_tensors(model)] == ["weight", "bias"]
    assert checkpoint_filter([]) is None


def test_owned_parameters_are_unmapped_and_later_converters_win() -> None:
    model = _model()
    apply_converters(model, [_AddsScale(), _TrainsBias()])
    assert getattr(model.scale, NOT_MAPPED) is True
    assert not hasattr(model.weight, NOT_MAPPED)
    assert [n for n, _ in mapped_tensors(model)] == ["weight", "bias"]
    trainable = {n: p.requires_grad for n, p in model.named_parameters()}
    assert trainable == {"weight": False, "bias": True, "scale": True}


def test_checkpoint_filter_keeps_a_key_every_converter_keeps() -> None:
    keep = checkpoint_filter([_AddsScale(), _TrainsBias()])
    assert [k for k in ("weight", "bias", "scale") if keep(k)] == ["scale"]
    keep_all = checkpoint_filter([_TrainsBias()])
    assert [k for k in ("weight", "bias", "scale") if keep_all(k)] == ["weight", "bias", "scale"]


def test_base_converter_exports_what_it_is_given() -> None:
    tensors = {"weight": torch.arange(6.0).view(2, 3)}
    assert ModelConverter().export(_model(), tensors) is tensors
