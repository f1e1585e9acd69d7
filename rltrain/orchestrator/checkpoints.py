"""Run-level checkpoints: every role's checkpoint plus the driver's state, complete or absent.

Layout under ``root`` (``<run dir>/checkpoints``)::

    step_<n>/actor/, step_<n>/critic/   role checkpoints (Megatron distributed, atomic themselves)
    step_<n>/driver_state.json          step, data position, KL controller
    .tmp-step_<n>/                      a save in progress or killed mid-write: never loaded
    latest                              "step_<n>", replaced atomically once step_<n> is complete

A save writes everything into ``.tmp-step_<n>``, renames it, and only then rewrites ``latest``, so a
crash at any point leaves ``latest`` naming a complete checkpoint; older ones beyond ``keep`` are
deleted after that. On resume, leftovers of unfinished saves are reported and ignored.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

LATEST = "latest"
STATE_FILE = "driver_state.json"
_TMP = ".tmp-"


class RunCheckpoints:
    """``is_writer``/``barrier``: in the torchrun mode every rank runs the driver; rank 0 alone touches
    the directory structure and the others wait at the barriers (the role saves are collective)."""

    def __init__(
        self,
        root: str | Path,
        *,
        keep: int | None,
        is_writer: bool = True,
        barrier: Callable[[], None] = lambda: None,
    ) -> None:
        self.root = Path(root)
        self.keep = keep
        self.is_writer = is_writer
        self.barrier = barrier

    def save(self, step: int, *, write_roles: Callable[[Path], None], state: dict[str, Any]) -> Path:
        """Write roles (``write_roles(tmp_dir)``) and ``state`` as ``step_<step>``; returns its path."""
        name = f"step_{step}"
        tmp, final = self.root / f"{_TMP}{name}", self.root / name
        if self.is_writer:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        self.barrier()
        write_roles(tmp)
        self.barrier()
        if self.is_writer:
            self._publish(tmp, final, name, state)
        self.barrier()
        return final

    def _publish(self, tmp: Path, final: Path, name: str, state: dict[str, Any]) -> None:
        (tmp / STATE_FILE).write_text(json.dumps(state, indent=1) + "\n")
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        marker = self.root / f"{_TMP}{LATEST}"
        marker.write_text(name + "\n")
        os.replace(marker, self.root / LATEST)
        self._prune(keep_name=name)
        log.info("checkpoint %s written", final)

    def _prune(self, *, keep_name: str) -> None:
        if self.keep is None:
            return
        complete = sorted((p for p in self.root.glob("step_*") if (p / STATE_FILE).exists()), key=_step_of)
        for old in complete[: max(len(complete) - self.keep, 0)]:
            if old.name != keep_name:
                shutil.rmtree(old)

    def latest(self) -> Path | None:
        """The checkpoint ``latest`` names, reporting unfinished saves it ignores."""
        for leftover in self.root.glob(f"{_TMP}step_*"):
            log.warning("ignoring %s: a checkpoint save that did not finish", leftover)
        marker = self.root / LATEST
        if not marker.exists():
            return None
        path = self.root / marker.read_text().strip()
        if not (path / STATE_FILE).exists():
            raise FileNotFoundError(f"{marker} names {path}, which is not a complete checkpoint")
        return path

    def resume_path(self, explicit: str | None) -> Path | None:
        if explicit is None:
            return self.latest()
        path = Path(explicit)
        if not (path / STATE_FILE).exists():
            raise FileNotFoundError(
                f"trainer.resume_from_path={explicit}: no {STATE_FILE} there (not a run checkpoint)"
            )
        return path

    @staticmethod
    def read_state(path: Path) -> dict[str, Any]:
        return json.loads((path / STATE_FILE).read_text())


def _step_of(path: Path) -> int:
    suffix = path.name.removeprefix("step_")
    return int(suffix) if suffix.isdigit() else -1
