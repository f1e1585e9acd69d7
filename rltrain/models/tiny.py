"""Tiny random Hugging Face models and a small BPE tokenizer, built locally (no model hub).

Tests, the CPU quickstart and benchmarks use these. Everything is deterministic for a given seed:
the tokenizer is trained on a fixed corpus, the weights come from ``torch.manual_seed(seed)``.

The default shapes are each model family's ``tiny_preset`` (``megatron_bridge/models/``), the
smallest that every backend accepts: vLLM's CPU attention needs a head size of 32 or more, Megatron
tensor parallelism at TP=2 needs heads and KV heads divisible by 2.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch

from megatron_bridge.hf_config import CONFIG_CLASS_OF
from megatron_bridge.registry import family_types, get_family

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]

# ChatML, the format of Qwen2 and SmolLM2; `add_generation_prompt` opens the assistant turn.
CHATML_TEMPLATE = (
    # With tools (a multi-turn run's schemas), a system turn names them; without, nothing changes.
    "{% if tools %}{{ '<|im_start|>system\nTools: ' }}"
    "{% for tool in tools %}{{ tool['function']['name'] }}{% if not loop.last %}{{ ', ' }}{% endif %}"
    "{% endfor %}{{ '<|im_end|>\n' }}{% endif %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def default_corpus() -> list[str]:
    """A fixed corpus covering digits, arithmetic, chat roles and plain English words."""
    lines = [
        "You are a helpful assistant. Answer with the number only.",
        "What is 12 + 7? The answer is 19.",
        "Compute 3 * 4 - 5 and give the result. #### 7",
        "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
        "system user assistant question answer think step by step",
    ]
    for a in range(0, 100, 7):
        for b in range(0, 100, 11):
            lines.append(f"{a} + {b} = {a + b}. {a} - {b} = {a - b}. {a} * {b} = {a * b}.")
    return lines


def tool_call_corpus() -> list[str]:
    """:func:`default_corpus` plus Hermes-style calculator calls and tool turns (so that the tool-call
    syntax takes few tokens of a tiny vocabulary)."""
    lines = default_corpus()
    for a in range(0, 1000, 37):
        b = (a * 7 + 13) % 1000
        call = json.dumps({"name": "calculator", "arguments": {"expression": f"{a} + {b}"}})
        lines.append(f"<tool_call>\n{call}\n</tool_call> tool {a + b} Tools: calculator, python")
    return lines


TOKENIZER_CORPORA = {"default": default_corpus, "tool_calls": tool_call_corpus}
"""Corpora a tiny tokenizer can be trained on, by name (``model.tiny.tokenizer_corpus``)."""


def build_tiny_tokenizer(*, vocab_size: int = 512, corpus: list[str] | None = None):
    """Train a byte-level BPE tokenizer on ``corpus`` and wrap it as a transformers fast tokenizer.

    Single digits are never merged (``individual_digits``), which keeps arithmetic learnable.
    Returns a ``PreTrainedTokenizerFast`` with a ChatML chat template, ``<|endoftext|>`` as EOS
    and ``<|pad|>`` as padding.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus or default_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|pad|>",
        bos_token=None,
        unk_token=None,
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast


def tiny_hf_config(model_type: str, *, vocab_size: int, **overrides: Any):
    """An HF ``PretrainedConfig`` of the tiny model of ``model_type``: its family's ``tiny_preset``
    (``megatron_bridge/models/``) with ``overrides`` applied."""
    from transformers import AutoConfig

    supported = family_types()
    if model_type not in supported:
        raise ValueError(f"no tiny preset for model_type={model_type!r}; known: {supported}")
    kwargs = {**copy.deepcopy(dict(get_family(model_type).tiny_preset)), **overrides}
    kwargs.setdefault("dtype", "float32")
    return AutoConfig.for_model(model_type, vocab_size=vocab_size, **kwargs)


def build_tiny_model(
    model_type: str = "llama",
    *,
    tokenizer=None,
    seed: int = 0,
    init_std: float = 0.02,
    **overrides: Any,
):
    """Return ``(model, tokenizer)``: a randomly initialised fp32 HF causal LM and its tokenizer.

    Token ids of the tokenizer's special tokens are written into the model config so that
    generation stops at ``<|endoftext|>`` or ``<|im_end|>``.
    """
    tokenizer = tokenizer or build_tiny_tokenizer()
    config = tiny_hf_config(
        model_type, vocab_size=tiny_vocab_size(tokenizer), initializer_range=init_std, **overrides
    )
    return _random_model(config, tokenizer, seed), tokenizer


def tiny_vocab_size(tokenizer) -> int:
    """The tokenizer's vocabulary in embedding rows padded to a multiple of 64, as released models
    pad theirs (Qwen2: 151,643 tokens in 151,936 rows): tensor parallelism splits it evenly, at TP
    up to 64."""
    return -(-len(tokenizer) // 64) * 64


def _random_model(config: Any, tokenizer, seed: int):
    """A randomly initialised fp32 causal LM of the HF ``config``, its special token ids the
    tokenizer's (generation stops at ``<|endoftext|>``)."""
    from transformers import AutoModelForCausalLM

    config.eos_token_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    config.pad_token_id = tokenizer.pad_token_id
    config.bos_token_id = None
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.eval()


def tiny_model_from_config(config: dict[str, Any], *, tokenizer, seed: int = 0):
    """A randomly initialised fp32 HF causal LM of the ``config.json`` dict ``config`` (a released
    checkpoint's, shrunk in its sizes), with ``tokenizer``'s vocabulary and special tokens."""
    from transformers import CONFIG_MAPPING

    config = {**config, "vocab_size": tiny_vocab_size(tokenizer)}
    config.pop("auto_map", None)  # remote code: the model is built by transformers' own class
    model_type = config.pop("model_type")  # kimi_k2 has no class of its own in transformers
    return _random_model(
        CONFIG_MAPPING[CONFIG_CLASS_OF.get(model_type, model_type)].from_dict(config), tokenizer, seed
    )


def save_tiny_model(
    out_dir: str | Path, model_type: str = "llama", *, seed: int = 0, **overrides: Any
) -> Path:
    """Build a tiny model and save it with its tokenizer as an HF directory (safetensors); returns the path."""
    model, tokenizer = build_tiny_model(model_type, seed=seed, **overrides)
    return save_pretrained_with_tokenizer(model, tokenizer, out_dir)


def save_pretrained_with_tokenizer(model, tokenizer, out_dir: str | Path) -> Path:
    """Save an HF model (safetensors), its tokenizer and a generation config stopping at EOS / ``<|im_end|>``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    eos_ids = [tokenizer.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_end|>")]
    generation_config = {"eos_token_id": eos_ids, "pad_token_id": tokenizer.pad_token_id}
    (out / "generation_config.json").write_text(json.dumps(generation_config, indent=2) + "\n")
    return out


def randomize_expert_bias(hf_dir: str | Path, *, seed: int = 3, scale: float = 0.05) -> None:
    """Give a saved DeepSeek-V3 checkpoint's expert biases (``e_score_correction_bias``, which HF
    initialises to zeros) random values of ``scale`` that change its routing, in place."""
    from safetensors.torch import load_file, save_file

    path = Path(hf_dir) / "model.safetensors"
    state = load_file(path)
    generator = torch.Generator().manual_seed(seed)
    for name in state:
        if name.endswith("e_score_correction_bias"):
            noise = torch.randn(state[name].shape, generator=generator) * scale
            state[name] = noise.to(state[name].dtype)  # the dtype the checkpoint keeps it in
    save_file(state, path, metadata={"format": "pt"})


def randomize_all_weights(
    hf_dir: str | Path, *, seed: int, matrix_std: float = 0.15, stds: dict[str, float] | None = None
) -> Path:
    """Give every tensor of a saved checkpoint random values large enough to matter, in place (the
    random init leaves biases at zero and GPT-OSS's sinks near it): biases and sinks ~ N(0, 0.5),
    norms in [0.5, 1.5), other tensors ~ N(0, ``matrix_std``), or ``stds[suffix]`` for a name ending
    in that suffix. Returns the folder."""
    from safetensors.torch import load_file, save_file

    path = Path(hf_dir) / "model.safetensors"
    state = load_file(path)
    generator = torch.Generator().manual_seed(seed)
    for name, tensor in state.items():
        if name.endswith(("bias", "sinks")):
            state[name] = 0.5 * torch.randn(tensor.shape, generator=generator)
        elif "norm" in name:
            state[name] = 0.5 + torch.rand(tensor.shape, generator=generator)
        else:
            std = next((v for k, v in (stds or {}).items() if name.endswith(k)), matrix_std)
            state[name] = std * torch.randn(tensor.shape, generator=generator)
    save_file(state, path, metadata={"format": "pt"})
    return Path(hf_dir)


def add_mtp_layers(hf_dir: str | Path, *, seed: int = 5, std: float = 0.02) -> list[str]:
    """Add the multi-token-prediction layers that ``config.json`` declares (``num_nextn_predict_layers``)
    to a saved checkpoint, in place, as DeepSeek-V3's release stores them and transformers does not
    write them: decoder layer ``num_hidden_layers + i`` with a whole decoder layer (random, shaped
    like the last decoder layer's tensors), ``enorm``/``hnorm``/``shared_head.norm`` (random around
    1), ``eh_proj`` ([hidden, 2 × hidden], random) and copies of the main embedding and LM head, in
    the checkpoint's dtype. Returns the names added."""
    from safetensors.torch import load_file, save_file

    from megatron_bridge.bridge import Bridge

    directory = Path(hf_dir)
    config = json.loads((directory / "config.json").read_text())
    bridge = Bridge.from_hf_config(config)
    path = directory / "model.safetensors"
    state = load_file(path)
    generator = torch.Generator().manual_seed(seed)
    num_layers, hidden = bridge.dims.num_layers, bridge.dims.hidden_size
    added = [name for name in bridge.hf_names() if name not in state]
    dtype = state["model.embed_tokens.weight"].dtype  # the checkpoint's own (bf16 for a bf16 one)
    for name in added:
        _, _, rest = name.removeprefix("model.layers.").partition(".")
        if rest in ("embed_tokens.weight", "shared_head.head.weight"):
            main = "model.embed_tokens.weight" if rest == "embed_tokens.weight" else "lm_head.weight"
            state[name] = state[main].clone()
        elif rest.endswith("norm.weight") and f"model.layers.{num_layers - 1}.{rest}" not in state:
            state[name] = (1 + std * torch.randn(hidden, generator=generator)).to(dtype)
        elif rest == "eh_proj.weight":
            state[name] = (std * torch.randn(hidden, 2 * hidden, generator=generator)).to(dtype)
        else:
            like = state[f"model.layers.{num_layers - 1}.{rest}"]
            noise = std * torch.randn(like.shape, generator=generator, dtype=like.dtype)
            state[name] = (1 + noise) if rest.endswith("norm.weight") else noise
    save_file(state, path, metadata={"format": "pt"})
    return added
