"""MkDocs hook: adds the config reference page, rendered from the config dataclasses at build time.

The repository root goes first on ``sys.path``, so the page describes the ``rltrain/config/`` of the
checkout being built, whichever rltrain the environment has installed.
"""

import sys
from pathlib import Path

from mkdocs.structure.files import File, Files

ROOT = str(Path(__file__).resolve().parents[2])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from rltrain.config.reference import render  # noqa: E402  (after the root is on the path)

PAGE = "config-reference.md"


def on_files(files: Files, config) -> Files:
    files.append(File.generated(config, PAGE, content=render()))
    return files
