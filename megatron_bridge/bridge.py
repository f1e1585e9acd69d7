"""A family's mapping table bound to one model's dimensions: the full list of tensor units, both ways.

Contract:
- ``Bridge.units`` lists every unit of the model (layer-major order); each unit names its canonical
  Megatron tensors and its HF tensors. ``hf_names()`` is exactly the tensor set of an HF checkpoint
  of the model; ``megatron_names()`` the canonical parameters of a TP=PP=EP=1 model.
- ``to_megatron``/``to_hf`` convert one unit of full tensors; errors name the unit's tensors.
- ``hf_to_megatron``/``megatron_to_hf`` convert whole state dicts (small models, tests) and fail on
  missing or unexpected names, naming them.
- Tied embeddings: the output layer unit reads ``embed_tokens`` and is never exported; it exists
  only on pipeline stages that hold a separate copy of the output weight.
- ``head`` says which HF head the Megatron ``output_layer.weight`` is: ``"lm"`` (the causal LM's
  vocab-parallel ``lm_head.weight``, or the tied embedding) or ``"score"`` (the scalar head
  [1, hidden] of a ``*ForSequenceClassification`` checkpoint, ``family.score_head``, replicated over
  TP and never tied): the reward model. The body's units are the same for both.
- Multi-token prediction (``dims.num_mtp_layers``; rows named ``mtp.layers.*``, Megatron-Core's
  ``MultiTokenPredictionBlock``): MTP layer ``i`` is HF decoder layer ``num_layers + i``; its inner
  transformer layer takes the rows of the last decoder layer's kind (dense or MoE, as Megatron
  builds it from the last layer's spec). ``CopyOf`` rows (an MTP layer's own embedding and head)
  join the unit of the shared Megatron tensor (``WithCopies``). A score head has no MTP layers.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch

from megatron_bridge.dims import ModelDims
from megatron_bridge.family import ModelFamily
from megatron_bridge.mappings import AnyMapping, CopyOf, GroupedExperts, Replicated, WithCopies
from megatron_bridge.naming import fill, num_wildcards
from megatron_bridge.registry import get_family

_OUTPUT = "output_layer.weight"
_EMBED = "embedding.word_embeddings.weight"
_EMBED_HF = "model.embed_tokens.weight"
MTP_PREFIX = "mtp.layers."
"""Rows of multi-token-prediction layers: their first wildcard is the MTP layer ``i``, which HF
stores as decoder layer ``num_layers + i``; a score head (reward model) has none."""

Head = Literal["lm", "score"]
"""The HF head ``output_layer.weight`` maps to: the causal LM's ``lm_head`` or a sequence
classifier's ``score`` (a reward model)."""


@dataclass(frozen=True)
class Unit:
    """One conversion unit: Megatron tensors ``megatron_names`` ↔ HF tensors ``hf_names``."""

    mapping: AnyMapping
    megatron_names: tuple[str, ...]
    hf_names: tuple[str, ...]
    tied: bool = False
    """The tied output layer: loaded from the embedding, not part of the HF checkpoint."""

    @property
    def is_expert(self) -> bool:
        return self.mapping.is_expert


class Bridge:
    """Mappings of ``family`` resolved for a model of shape ``dims`` with output head ``head``."""

    def __init__(self, family: ModelFamily, dims: ModelDims, *, head: Head = "lm") -> None:
        if head not in ("lm", "score"):
            raise ValueError(f"head={head!r}; expected 'lm' or 'score'")
        self.family = family
        self.dims = dims
        self.head: Head = head
        self._check_mtp()
        self.units = self._build_units()
        self._by_megatron = {n: (u, i) for u in self.units for i, n in enumerate(u.megatron_names)}
        self._by_hf = {n: u for u in self.units if not u.tied for n in u.hf_names}

    @classmethod
    def from_hf_config(
        cls, config: Any, *, tp_size: int = 1, make_vocab_size_divisible_by: int = 128, head: Head = "lm"
    ) -> Bridge:
        """The bridge of the family of ``config``'s ``model_type`` (a ``*ForSequenceClassification``
        config has its causal LM's); ``head="score"`` for a reward model."""
        dims = ModelDims.from_hf_config(
            config, tp_size=tp_size, make_vocab_size_divisible_by=make_vocab_size_divisible_by
        )
        return cls(get_family(dims.model_type), dims, head=head)

    def main_model(self) -> Bridge:
        """This bridge without the multi-token-prediction layers: what an inference engine serves."""
        if not self.num_mtp_layers:
            return self
        return Bridge(self.family, replace(self.dims, num_mtp_layers=0), head=self.head)

    @property
    def score_head(self) -> str | None:
        """HF name of the scalar head ``output_layer.weight`` loads (``head="score"``), else None."""
        return self.family.score_head if self.head == "score" else None

    def _values(self, mapping: AnyMapping) -> list[tuple[int, ...]]:
        """Wildcard values of the mapping's units: (), (layer,) or (layer, expert)."""
        grouped = isinstance(mapping, GroupedExperts)
        n = num_wildcards(mapping.megatron) - (1 if grouped else 0)
        dense = set(self.dims.dense_layers)
        kind = mapping.layers
        if mapping.megatron.startswith(MTP_PREFIX):
            last_dense = (self.dims.num_layers - 1) in dense
            wanted = kind == "all" or (kind == "dense") == last_dense
            layers = list(range(self.num_mtp_layers)) if wanted else []
        else:
            layers = [
                layer
                for layer in range(self.dims.num_layers)
                if kind == "all" or (kind == "dense") == (layer in dense)
            ]
        per_expert = mapping.is_expert and not grouped
        if n == 0 and not per_expert:
            return [()]
        if n == 1 and not per_expert:
            return [(layer,) for layer in layers]
        if n == 2 and per_expert:
            return [(layer, e) for layer in layers for e in range(self.dims.num_experts)]
        raise ValueError(f"mapping {mapping.megatron!r}: {n} wildcards do not fit a {type(mapping).__name__}")

    def _check_mtp(self) -> None:
        """Refuse MTP layers the family's table cannot map, naming the config key."""
        if not self.num_mtp_layers:
            return
        key = f"num_nextn_predict_layers={self.dims.num_mtp_layers}"
        if not any(row.megatron.startswith(MTP_PREFIX) for row in self.family.mappings):
            raise NotImplementedError(
                f"{self.family.name}: {key}, but the bridge has no multi-token-prediction rows for this family"
            )
        if (self.dims.num_layers - 1) in self.dims.dense_layers:
            # Megatron builds an MTP layer like the last decoder layer; HF's MTP layers are MoE layers.
            raise NotImplementedError(
                f"{self.family.name}: {key} with a dense last decoder layer (first_k_dense_replace="
                f"{len(self.dims.dense_layers)}): Megatron would build the MTP layer dense"
            )

    @property
    def num_mtp_layers(self) -> int:
        """Multi-token-prediction layers of the model (none behind a score head)."""
        return self.dims.num_mtp_layers if self.head == "lm" else 0

    def _copies(self) -> dict[str, tuple[str, ...]]:
        """Canonical Megatron name → the HF names of its copies in the MTP layers (``CopyOf`` rows)."""
        copies: dict[str, list[str]] = {}
        tied = self.dims.tie_word_embeddings
        for row in self.family.mappings:
            if isinstance(row, CopyOf):
                target = _EMBED if tied and row.megatron == _OUTPUT else row.megatron
                for i in range(self.num_mtp_layers):
                    copies.setdefault(target, []).append(fill(row.hf, (self.dims.num_layers + i,)))
        return {name: tuple(names) for name, names in copies.items()}

    def _build_units(self) -> list[Unit]:
        units: list[tuple[float, int, Unit]] = []
        copies = self._copies()
        for order, mapping in enumerate(self.family.mappings):
            if getattr(mapping, "query", "any") not in ("any", self.dims.mla_query):
                continue  # the other MLA query layout's rows
            if getattr(mapping, "switch", None) not in (None, *self.dims.switches):
                continue  # a row the config switches off (GLM-4.5 without use_qk_norm)
            if isinstance(mapping, CopyOf):
                continue  # joins the unit of the tensor it copies
            if self.head == "score" and mapping.megatron == _OUTPUT:
                mapping = Replicated(_OUTPUT, self.family.score_head)
            elif mapping.megatron in copies:
                mapping = WithCopies(mapping, copies[mapping.megatron])
            if mapping.is_expert and self.dims.num_experts == 0:
                raise ValueError(
                    f"{self.family.name}: expert row {mapping.megatron!r} but the config has no experts"
                )
            mtp = mapping.megatron.startswith(MTP_PREFIX)
            for values in self._values(mapping):
                megatron = tuple(mapping.megatron_names(values, self.dims))
                # MTP layer i is HF decoder layer num_layers + i
                hf_values = (values[0] + self.dims.num_layers, *values[1:]) if mtp else values
                hf = tuple(mapping.hf_names(hf_values))
                tied = megatron == (_OUTPUT,) and self.dims.tie_word_embeddings and self.head == "lm"
                if tied:
                    hf = (_EMBED_HF,)
                if values:
                    key = float(hf_values[0])
                else:
                    key = -1.0 if megatron[0].startswith("embedding.") else float("inf")
                units.append((key, order, Unit(mapping, megatron, hf, tied=tied)))
        units.sort(key=lambda item: (item[0], item[1]))
        return [u for _, _, u in units]

    # ---- lookups -------------------------------------------------------------------------
    def hf_names(self) -> list[str]:
        return [n for u in self.units if not u.tied for n in u.hf_names]

    def megatron_names(self, *, include_tied_output: bool = False) -> list[str]:
        return [n for u in self.units if include_tied_output or not u.tied for n in u.megatron_names]

    def unit_of_megatron(self, name: str) -> tuple[Unit, int]:
        """The unit holding canonical Megatron tensor ``name`` and its position in the unit."""
        if name not in self._by_megatron:
            raise KeyError(f"Megatron parameter {name!r} has no mapping in the {self.family.name} bridge")
        return self._by_megatron[name]

    def unit_of_hf(self, name: str) -> Unit:
        if name not in self._by_hf:
            raise KeyError(f"HF tensor {name!r} has no mapping in the {self.family.name} bridge")
        return self._by_hf[name]

    def mapping_for_megatron(self, name: str) -> AnyMapping:
        return self.unit_of_megatron(name)[0].mapping

    # ---- conversion ----------------------------------------------------------------------
    def to_megatron(self, unit: Unit, hf: list[torch.Tensor]) -> list[torch.Tensor]:
        try:
            return unit.mapping.to_megatron(hf, self.dims)
        except (RuntimeError, ValueError) as err:
            shapes = [tuple(t.shape) for t in hf]
            raise ValueError(f"cannot convert HF {list(unit.hf_names)} (shapes {shapes}): {err}") from err

    def to_hf(self, unit: Unit, megatron: list[torch.Tensor]) -> list[torch.Tensor]:
        try:
            return unit.mapping.to_hf(megatron, self.dims)
        except (RuntimeError, ValueError) as err:
            shapes = [tuple(t.shape) for t in megatron]
            raise ValueError(
                f"cannot convert Megatron {list(unit.megatron_names)} (shapes {shapes}): {err}"
            ) from err

    def iter_hf_to_megatron(self, hf: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
        """Canonical ``(megatron_name, full tensor)`` pairs from an HF state dict (exact name set)."""
        check_names("HF checkpoint", present=hf.keys(), expected=self.hf_names())
        for unit in self.units:
            if unit.tied:
                continue
            yield from zip(unit.megatron_names, self.to_megatron(unit, [hf[n] for n in unit.hf_names]))

    def hf_to_megatron(self, hf: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return dict(self.iter_hf_to_megatron(hf))

    def megatron_to_hf(self, megatron: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """HF state dict from canonical full Megatron tensors (exact name set, tied output excluded)."""
        check_names("Megatron state", present=megatron.keys(), expected=self.megatron_names())
        out: dict[str, torch.Tensor] = {}
        for unit in self.units:
            if not unit.tied:
                out.update(zip(unit.hf_names, self.to_hf(unit, [megatron[n] for n in unit.megatron_names])))
        return out


def check_names(what: str, *, present: Any, expected: Any) -> None:
    """Raise naming the missing and unexpected tensors of ``what``."""
    present, expected = set(present), set(expected)
    missing, unexpected = sorted(expected - present), sorted(present - expected)
    if missing or unexpected:
        raise KeyError(f"{what}: missing tensors {missing[:20]}; unexpected tensors {unexpected[:20]}")
