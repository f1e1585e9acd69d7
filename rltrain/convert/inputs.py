"""What a conversion checks before any rank starts, each problem one ``ConversionError`` line naming it.

Contract: ``check_inputs(mode, src, dst, ...)`` returns the HF directory holding the model's config
(and tokenizer) or raises ``ConversionError`` for, in this order: an unknown mode; parallel sizes
below 1; a source that is not a readable checkpoint (an HF directory without safetensors, a
safetensors file with a garbled header or shorter than its header says, an index naming a missing
shard; a Megatron directory without ``latest``, or whose step lacks its metadata, has an unreadable
``.metadata`` or a shard missing or shorter than the metadata says), naming the file; a missing or
unreadable ``config.json``; a ``model_type`` no bridge supports (listing the supported ones); a
Megatron source whose routers were trained with a routing its HF family cannot express (a sigmoid
score or an expert bias on a softmax family such as Mixtral or Qwen-MoE): the result would route
tokens differently, so neither an export nor a reshard (which builds the family's model) is made; every
layout the model cannot take (``megatron_bridge.layout``: both numbers of each, as the Megatron
builder would say it on the ranks); HF tensors missing or unexpected for the model; and a ``dst``
that is a file, or a non-empty directory without ``overwrite`` (with it, one that holds the source
or the HF config). Only cheap checks run here: headers, sizes and names, no tensor data.
``staging_dir(dst)`` is where the ranks write until the launcher publishes the result as ``dst``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from megatron_bridge.bridge import Bridge, check_names
from megatron_bridge.dcp_io import DistCheckpointReader
from megatron_bridge.errors import CheckpointError
from megatron_bridge.hf_io import HFCheckpointReader
from megatron_bridge.layout import layout_problems
from megatron_bridge.registry import get_family
from rltrain.convert.report import MODES, ConversionError


def staging_dir(dst: Path) -> Path:
    """The directory beside ``dst`` that a conversion writes into; its name says it is incomplete."""
    return dst.with_name(f".{dst.name}.incomplete")


def check_inputs(
    mode: str,
    src: Path,
    dst: Path,
    *,
    hf_config_dir: str | Path | None,
    tp: int,
    pp: int,
    ep: int,
    overwrite: bool,
    first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
    etp: int | None = None,
) -> Path:
    if mode not in MODES:
        raise ConversionError(f"unknown conversion mode {mode!r}; expected one of {', '.join(MODES)}")
    bad = [f"--{name} {size}" for name, size in (("tp", tp), ("pp", pp), ("ep", ep)) if size < 1]
    if bad:
        raise ConversionError(f"{', '.join(bad)}: parallel sizes must be 1 or more")
    step = None
    try:
        if mode == "hf-to-mcore":
            reader = HFCheckpointReader(src)
            hf_dir = src
        else:
            step = _check_megatron_source(src)
            hf_dir = Path(hf_config_dir) if hf_config_dir is not None else src / "hf"
    except (CheckpointError, FileNotFoundError) as err:
        raise ConversionError(str(err)) from None
    config = _read_config(hf_dir, mode)
    where = hf_dir / "config.json"
    try:
        get_family(config.get("model_type"))
    except (KeyError, NotImplementedError) as err:
        raise ConversionError(f"{where}: {err.args[0]}") from None
    if step is not None:
        _check_routing(step, config, where)
    problems = layout_problems(
        config, tp=tp, pp=pp, ep=ep, etp=etp, first=first_stage_layers, last=last_stage_layers
    )
    if problems:
        stages = f" --etp {etp}" if etp is not None else ""
        stages += "".join(
            f" --decoder-{which}-pipeline-num-layers {n}"
            for which, n in (("first", first_stage_layers), ("last", last_stage_layers))
            if n is not None
        )
        raise ConversionError(
            f"{where}: the {config['model_type']} model cannot take --tp {tp} --pp {pp} --ep {ep}{stages}: "
            + "; ".join(problems)
        )
    if mode == "hf-to-mcore":
        try:
            expected = Bridge.from_hf_config(config).hf_names()
            check_names(f"HF checkpoint {src}", present=reader.names(), expected=expected)
        except (KeyError, NotImplementedError) as err:
            raise ConversionError(str(err.args[0])) from None
    _check_destination(dst, overwrite=overwrite, keep=(src, hf_dir))
    return hf_dir


def _check_megatron_source(src: Path) -> DistCheckpointReader:
    latest = src / "latest"
    if not latest.is_file():
        raise FileNotFoundError(
            f"{src}: no Megatron checkpoint ({latest} is missing); pass the directory that "
            "holds `latest`, e.g. a conversion's output or a run's checkpoints/step_N/actor"
        )
    step = src / latest.read_text(encoding="utf-8", errors="replace").strip()
    if not (step / "metadata.json").is_file():
        raise FileNotFoundError(
            f"{latest} names {step}, which is not a complete checkpoint (no metadata.json)"
        )
    return DistCheckpointReader(step)  # reads .metadata and checks every shard file's size, naming the file


def _check_routing(source: DistCheckpointReader, config: dict[str, Any], where: Path) -> None:
    """Refuse a MoE checkpoint whose routing (as ``save_checkpoint`` recorded it, or, for one written
    before that record, its expert-bias tensors) differs from what the HF family computes."""
    from rltrain.megatron.checkpoint import saved_routing

    moe = get_family(config["model_type"]).facts(config).moe
    if not moe:
        return
    trained = saved_routing(source.directory) or {}
    stored = source.keys()
    bias_keys = [k for k in stored if k.endswith("router.expert_bias")]
    score = trained.get("score_function") or moe.score_function
    trained_as = [f"model.moe.moe_router_score_function: {score}"] if score != moe.score_function else []
    if trained.get("expert_bias", bool(bias_keys)) and not moe.expert_bias:
        held = f" (it holds {bias_keys[0]})" if bias_keys else ""
        trained_as.append(f"model.moe.moe_router_enable_expert_bias: true{held}")
    if not trained_as:
        return
    family = f"a {moe.score_function} score" + ("" if moe.expert_bias else " and no expert bias")
    raise ConversionError(
        f"{source.directory}: its routers were trained with {', '.join(trained_as)}, but the "
        f"{config['model_type']} model of {where} routes by {family}: converting it would change "
        "which experts every token is sent to; keep this run's checkpoints in Megatron form (resume "
        "and evaluate with the same model.moe options)"
    )


def _read_config(hf_dir: Path, mode: str) -> dict[str, Any]:
    path = hf_dir / "config.json"
    if not path.is_file():
        raise ConversionError(
            f"{path} is missing: the HF config (and tokenizer) of the model"
            + ("" if mode == "hf-to-mcore" else "; pass --hf-config DIR (the model it was trained from)")
        )
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConversionError(f"{path}: not a readable HF config ({err})") from None
    if not isinstance(config, dict):
        raise ConversionError(f"{path}: not an HF config (a JSON object is expected)")
    return config


def _check_destination(dst: Path, *, overwrite: bool, keep: tuple[Path, ...]) -> None:
    if dst.exists() and not dst.is_dir():
        raise ConversionError(f"{dst} exists and is not a directory")
    entries = sorted(dst.iterdir()) if dst.is_dir() else []
    if not entries:
        return
    if not overwrite:
        raise ConversionError(
            f"{dst} is not empty ({len(entries)} entries, e.g. {entries[0].name}): convert into a new "
            "directory, or pass --overwrite to clear it first"
        )
    target = dst.resolve()
    for path in keep:
        resolved = path.resolve()
        if resolved == target or target in resolved.parents:
            raise ConversionError(
                f"--overwrite would delete {path}, which {dst} holds; choose another directory"
            )
