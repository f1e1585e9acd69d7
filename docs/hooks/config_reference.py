"""MkDocs hook: adds the config reference page, rendered from the config dataclasses at build time."""

from mkdocs.structure.files import File, Files

from rltrain.config.reference import render

PAGE = "config-reference.md"


def on_files(files: Files, config) -> Files:
    files.append(File.generated(config, PAGE, content=render()))
    return files
