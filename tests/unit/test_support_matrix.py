"""The model support matrix (``docs/model-support.md``) is current, and reads only what tests claim."""

from __future__ import annotations

import importlib.util
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("support_matrix", ROOT / "tools" / "support_matrix.py")
support_matrix = importlib.util.module_from_spec(spec)
sys.modules["support_matrix"] = support_matrix  # dataclasses look their module up there
spec.loader.exec_module(support_matrix)


def test_the_page_in_the_docs_is_what_the_script_makes_now() -> None:
    assert support_matrix.main(["--check"]) == 0, "run: python tools/support_matrix.py"


def _tests(tmp_path: Path, source: str) -> Path:
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_planted.py").write_text(textwrap.dedent(source))
    return tests


def test_markers_on_a_test_and_on_its_params_are_claims_of_that_test(tmp_path) -> None:
    tests = _tests(
        tmp_path,
        """
        import pytest

        @pytest.mark.supports("llama", "tp", "pp")
        def test_layouts():
            pass

        @pytest.mark.parametrize("x", [pytest.param(1, marks=pytest.mark.supports("mixtral", "cp", refused=True))])
        def test_refusal(x):
            pass

        def test_unmarked():
            pass
        """,
    )
    claims = support_matrix.collect_claims(tests)
    assert sorted((c.family, c.feature, c.refused, c.test) for c in claims) == [
        ("llama", "pp", False, "tests/test_planted.py::test_layouts"),
        ("llama", "tp", False, "tests/test_planted.py::test_layouts"),
        ("mixtral", "cp", True, "tests/test_planted.py::test_refusal"),
    ]
    page = support_matrix.render(
        claims, [("llama", ("llama",)), ("mixtral", ("mixtral",)), ("qwen2", ("qwen2",))]
    )
    rows = {
        line.split(" | ")[0].strip("| "): line.split(" | ")[2:]
        for line in page.splitlines()
        if line.startswith("| ")
    }
    columns = list(support_matrix.FEATURES)
    assert rows["llama"][columns.index("tp")] == "✓" and rows["llama"][columns.index("pp")] == "✓"
    assert rows["llama"][columns.index("cp")] == "—"
    assert rows["mixtral"][columns.index("cp")] == "refused"
    assert all(cell.strip(" |") == "—" for cell in rows["qwen2"])  # no test, no claim


def test_unknown_names_and_contradictions_are_problems() -> None:
    claim = support_matrix.Claim
    found = support_matrix.problems(
        [
            claim("gpt_neox", "tp", False, "t::a"),
            claim("llama", "flash", False, "t::b"),
            claim("llama", "cp", False, "t::c"),
            claim("llama", "cp", True, "t::d"),
        ],
        ["llama"],
    )
    assert len(found) == 3
    assert "unknown family 'gpt_neox'" in found[0] and "unknown feature 'flash'" in found[1]
    assert found[2] == "llama × cp: both supported and refused by tests"


def test_a_marker_in_a_test_body_is_an_error_not_a_silent_claim(tmp_path) -> None:
    tests = _tests(
        tmp_path,
        """
        import pytest

        def test_x():
            pytest.mark.supports("llama", "tp")
        """,
    )
    with pytest.raises(ValueError, match=r"test_planted.py:5: pytest.mark.supports inside a test's body"):
        support_matrix.collect_claims(tests)
