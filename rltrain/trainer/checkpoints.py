"""Run-level checkpoints: every role's checkpoint plus the driver's state, verified, complete or absent.

Layout under ``root`` (``<run dir>/checkpoints``)::

    step_<n>/actor/, step_<n>/critic/   role checkpoints (Megatron distributed)
    step_<n>/driver_state.json          step, data position, KL controller
    step_<n>/manifest.json              every other file with its size and checksum (manifest.py)
    .tmp-step_<n>/                      a save in progress or killed mid-write: never loaded
    latest                              "step_<n>", replaced atomically once step_<n> is complete

Save: everything goes into ``.tmp-step_<n>``, the manifest last; the directory is renamed, and only
then ``latest`` rewritten, so a crash at any point leaves ``latest`` naming a complete checkpoint.
Older ones beyond ``keep`` (counted among those not newer than the save) are deleted after that. A
save that fails raises :class:`CheckpointError` in one line naming the path and the cause, after
deleting its partial directory: a full disk (ENOSPC anywhere in the error, or the short write torch's
writer reports as "unexpected pos" with less free than the save needs) as "no space left on the
device" with the free space and what the save needs (the previous checkpoint's size, else more than
it had written), without the writers' internal text; any other cause (no permission, ...) with the
innermost error a worker's traceback names and the free space;
``latest`` still names the previous checkpoint, from which the run resumes once the cause is fixed.
A worker that died or stopped answering during the save
(:class:`~rltrain.trainer.recovery.WorkerLost`) is raised as itself, after the same clean-up,
for a restart to recover from.

Resume (:meth:`RunCheckpoints.resume`): candidates are the checkpoint ``latest`` names, then the
older ones, newest first; the first that verifies against its manifest and loads (the caller's
``load``, which raises :class:`CheckpointLoadError` when a role cannot load it) wins. Each one passed
over is said in one line naming the file and why. With ``latest`` missing or damaged the candidates
are all checkpoints, newest first (said in one line); directories newer than a valid ``latest`` (a
save killed between the rename and ``latest``) and unfinished saves are ignored, said likewise.
When none verifies and loads, :class:`CheckpointError` names each with its reason: a run directory
holding checkpoints never restarts from step 0 by itself. A fresh start over existing checkpoints
(``resume_mode: disable``) is refused unless the caller discards them (:meth:`start_fresh`).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rltrain.trainer.manifest import MANIFEST, Verification, verify_manifest, write_manifest
from rltrain.trainer.recovery import WorkerLost

log = logging.getLogger(__name__)

LATEST = "latest"
STATE_FILE = "driver_state.json"
_TMP = ".tmp-"
_STEP_NAME = re.compile(r"step_\d+")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be saved or resumed from; the message is one line naming the files."""


class CheckpointLoadError(CheckpointError):
    """Raised by a resume's ``load`` callback: the roles could not load a checkpoint that verified."""


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

    # ---------------------------------------------------------------------------------------- save
    def save(self, step: int, *, write_roles: Callable[[Path], None], state: dict[str, Any]) -> Path:
        """Write roles (``write_roles(tmp_dir)``) and ``state`` as ``step_<step>``; returns its path."""
        name = f"step_{step}"
        tmp, final = self.root / f"{_TMP}{name}", self.root / name
        try:
            if self.is_writer:
                self.root.mkdir(parents=True, exist_ok=True)
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir()
            self.barrier()
            write_roles(tmp)
            self.barrier()
            if self.is_writer:
                self._publish(tmp, final, name, state)
        except WorkerLost:  # a worker died or hung, not the save: the partial directory goes, the error stays
            self._discard(tmp)
            raise
        except Exception as err:  # re-raised as one line naming the path; the cause stays chained
            raise self._save_failed(name, tmp, err) from err
        self.barrier()
        return final

    def _publish(self, tmp: Path, final: Path, name: str, state: dict[str, Any]) -> None:
        (tmp / STATE_FILE).write_text(json.dumps(state, indent=1) + "\n")
        write_manifest(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        marker = self.root / f"{_TMP}{LATEST}"
        try:
            marker.write_text(name + "\n")
            os.replace(marker, self.root / LATEST)
        except OSError:
            # ``latest`` did not move: the save failed, and a complete-looking step_<n> must not stay.
            shutil.rmtree(final, ignore_errors=True)
            raise
        self._prune(saved=final)
        log.info("checkpoint %s written", final)

    def _discard(self, tmp: Path) -> None:
        if self.is_writer:  # frees what the partial save took, so that the next save can fit
            shutil.rmtree(tmp, ignore_errors=True)

    def _save_failed(self, name: str, tmp: Path, err: Exception) -> CheckpointError:
        written = _bytes_under(tmp) if tmp.is_dir() else 0
        self._discard(tmp)
        current, problem = self._read_marker()
        kept = f"{self.root / LATEST} still names {current}" if problem is None else "no earlier checkpoint"
        previous = self.root / current if problem is None and (self.root / current).is_dir() else None
        free = shutil.disk_usage(_existing(self.root)).free
        needed = _bytes_under(previous) if previous is not None else None
        if _no_space(err, short_of_space=needed is not None and free < needed):
            need = (
                f"about {_size(needed)} needed (the size of {previous.name})"
                if needed is not None
                else f"more than the {_size(written)} it had written needed"
            )
            return CheckpointError(
                f"checkpoint {name} could not be saved in {tmp}: no space left on the device "
                f"({_size(free)} free there, {need}); {kept}"
            )
        said = f"{_size(free)} free there"
        if needed is not None and free < needed:
            said += f", less than {previous.name} takes ({_size(needed)})"
        return CheckpointError(
            f"checkpoint {name} could not be saved in {tmp}: {_first_line(err)} ({said}); {kept}"
        )

    def _prune(self, *, saved: Path) -> None:
        """Keep the ``keep`` newest checkpoints up to ``saved``; newer ones (left by a resume that fell
        back past them) are replaced when the run saves their step again."""
        if self.keep is None:
            return
        older = sorted((p for p in self._step_dirs() if _step_of(p) < _step_of(saved)), key=_step_of)
        for old in older[: max(len(older) + 1 - self.keep, 0)]:
            shutil.rmtree(old)

    # -------------------------------------------------------------------------------------- resume
    def resume(self, load: Callable[[Path], int], *, explicit: str | None = None) -> int | None:
        """Load (``load(path)`` -> its step) the newest checkpoint that verifies and loads; its step.

        None when ``root`` holds no checkpoint. ``explicit`` (``trainer.resume_from_path``): that
        checkpoint only, which must verify.
        """
        if explicit is not None:
            check = verify_manifest(explicit)
            if not check.ok:
                raise CheckpointError(f"trainer.resume_from_path={explicit}: {check.summary()}")
            return load(Path(explicit))
        candidates, notes = self._candidates()
        for note in notes:
            log.warning("%s", note)
        passed_over = []
        for i, path in enumerate(candidates):
            check = verify_manifest(path)
            if check.ok:
                try:
                    return load(path)
                except CheckpointLoadError as err:
                    problem = str(err)
            else:
                problem = check.summary()
            passed_over.append(f"{path.name}: {problem}")
            after = f"falling back to {candidates[i + 1].name}" if i + 1 < len(candidates) else "none older"
            log.warning("cannot resume from %s: %s; %s", path, problem, after)
        if passed_over:
            raise CheckpointError(
                f"no checkpoint in {self.root} can be resumed from: " + "; ".join(passed_over)
            )
        return None

    def _candidates(self) -> tuple[list[Path], list[str]]:
        """Checkpoints to try, in order, and one line for each thing a resume passes over."""
        notes = [f"ignoring {p}: a checkpoint save that did not finish" for p in self._leftovers()]
        steps = sorted(self._step_dirs(), key=_step_of, reverse=True)
        marker = self.root / LATEST
        named, problem = self._read_marker()
        if not steps:
            if marker.exists():
                raise CheckpointError(
                    f"{marker} {problem or 'names ' + str(named)}, but {self.root} holds no checkpoint: "
                    f"delete {marker} to start from step 0"
                )
            return [], notes
        if problem is None and (self.root / named) not in steps:
            problem = f"names {named}, which does not exist"
        if problem is not None:
            notes.append(f"{marker} {problem}: resuming from the newest checkpoint that verifies")
            return steps, notes
        newest = _step_of(self.root / named)
        notes += [
            f"ignoring {p}: newer than {named}, which {marker} names" for p in steps if _step_of(p) > newest
        ]
        return [p for p in steps if _step_of(p) <= newest], notes

    def start_fresh(self, *, discard_existing: bool) -> None:
        """``resume_mode: disable``: refuse to start from step 0 over existing checkpoints, unless
        ``discard_existing``, which deletes them first."""
        existing = sorted(self._step_dirs(), key=_step_of)
        marker = self.root / LATEST
        if not existing and not marker.exists():
            return
        names = ", ".join(p.name for p in existing) or LATEST
        if not discard_existing:
            raise CheckpointError(
                f"trainer.resume_mode=disable, but {self.root} holds checkpoints ({names}): to start from "
                "step 0, use a new run directory (e.g. trainer.experiment_name=...) or set "
                "trainer.checkpoint.discard_existing=true, which deletes them"
            )
        if self.is_writer:
            for path in [*existing, *self._leftovers()]:
                shutil.rmtree(path)
            marker.unlink(missing_ok=True)
            log.warning(
                "trainer.checkpoint.discard_existing: deleted %s in %s; starting from step 0",
                names,
                self.root,
            )
        self.barrier()

    def newest(self) -> Path | None:
        """The checkpoint ``latest`` names, or None (no checkpoint, or ``latest`` missing or damaged)."""
        named, problem = self._read_marker()
        return None if problem is not None else self.root / named

    @staticmethod
    def read_state(path: Path) -> dict[str, Any]:
        return json.loads((path / STATE_FILE).read_text())

    # -------------------------------------------------------------------------------------- verify
    def verify_all(self) -> tuple[list[str], bool]:
        """Verify every checkpoint without loading it: (one line per finding, whether all is well)."""
        steps = sorted(self._step_dirs(), key=_step_of)
        if not steps and not (self.root / LATEST).exists():
            raise CheckpointError(f"{self.root}: no checkpoints there")
        lines, intact = [], []
        for path in steps:
            check = verify_manifest(path)
            lines.append(_verdict(check))
            if check.ok:
                intact.append(path)
        named, problem = self._read_marker()
        if problem is None:  # otherwise a note below says what is wrong with it
            lines.append(f"{self.root / LATEST}: names {named}")
        try:
            candidates, notes = self._candidates()
        except CheckpointError as err:
            return [*lines, str(err)], False
        lines += notes
        first = next((p for p in candidates if p in intact), None)
        lines.append(
            f"a resume would start from {first.name}"
            if first is not None
            else "no checkpoint verifies: a resume would stop"
        )
        all_well = len(intact) == len(steps) and problem is None and first is not None and first.name == named
        return lines, all_well

    # ------------------------------------------------------------------------------------- helpers
    def _step_dirs(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        return [p for p in self.root.iterdir() if _STEP_NAME.fullmatch(p.name) and p.is_dir()]

    def _leftovers(self) -> list[Path]:
        return sorted(self.root.glob(f"{_TMP}step_*"))

    def _read_marker(self) -> tuple[str | None, str | None]:
        """(the checkpoint name ``latest`` holds, or None; why it holds none: missing or damaged)."""
        marker = self.root / LATEST
        if not marker.is_file():
            return None, "is missing"
        raw = marker.read_bytes()
        name = raw.decode("utf-8", errors="replace").strip()
        if not _STEP_NAME.fullmatch(name):
            return None, f"is damaged (it holds {raw[:40]!r}, not a checkpoint name)"
        return name, None


def verify_path(path: str | Path) -> tuple[list[str], bool]:
    """``rltrain checkpoint verify``: ``path`` is a run directory, its ``checkpoints/`` or a single
    checkpoint; (one line per finding, whether all is well). Reads files, loads no model."""
    path = Path(path)
    if (path / MANIFEST).exists() or (path / STATE_FILE).exists():
        check = verify_manifest(path)
        return [_verdict(check)], check.ok
    root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    return RunCheckpoints(root, keep=None).verify_all()


def _verdict(check: Verification) -> str:
    if check.ok:
        return f"{check.directory}: ok ({check.num_files} files, {_size(check.num_bytes)})"
    return f"{check.directory}: FAILED: {check.summary()}"


def _step_of(path: Path) -> int:
    return int(path.name.removeprefix("step_"))


_ERROR_LINE = re.compile(r"^(?:[\w.]+\.)?\w+(?:Error|Exception): \S.*$", re.M)
"""A line of a traceback's text that names an exception and its message."""


def _first_line(err: BaseException) -> str:
    """The error's first line, and the innermost exception its text names beyond that (a worker's
    traceback ends in the one that started it, e.g. a short write of a full disk deep in a writer)."""
    text = str(err).strip()
    lines = text.splitlines()
    first = f"{type(err).__name__}: {lines[0] if lines else ''}"
    causes = [line for line in _ERROR_LINE.findall(text) if line.split(": ", 1)[1] not in first]
    return f"{first}, from {causes[-1].strip()}" if causes else first


def _size(num_bytes: int) -> str:
    if num_bytes < 1024:
        return f"{num_bytes} B"
    value, unit = num_bytes / 1024, "KiB"
    for bigger in ("MiB", "GiB", "TiB"):
        if value < 1024:
            break
        value, unit = value / 1024, bigger
    return f"{value:.1f} {unit}"


def _existing(path: Path) -> Path:
    """``path`` or its nearest existing parent (what ``disk_usage`` can measure)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _bytes_under(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


_SHORT_WRITE = "unexpected pos"
"""How torch's zip writer (``inline_container.cc``) reports a write the disk took only in part."""


def _no_space(err: BaseException, *, short_of_space: bool) -> bool:
    """Whether ``err`` is a full disk: ENOSPC in its chain or text (a worker's error travels as text),
    or a short write of torch's writer while less is free than the save needs."""
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno == errno.ENOSPC:
            return True
        seen = seen.__cause__ or seen.__context__
    text = str(err)
    if "No space left on device" in text or "[Errno 28]" in text:
        return True
    return short_of_space and _SHORT_WRITE in text
