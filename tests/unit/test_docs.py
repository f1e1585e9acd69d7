"""The README is a front page whose links resolve; the docs list every shipped recipe.

The docs site itself (every page in the nav, no broken link or anchor inside ``docs/``) is checked by
``make docs`` (``mkdocs build --strict``); the README lives outside the site, so its links are
checked here.
"""

import re
import unicodedata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """The anchor Python-Markdown's toc (and GitHub) give a heading: lower case, words joined by ``-``."""
    text = unicodedata.normalize("NFKD", heading).encode("ascii", "ignore").decode()
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # no headings inside code blocks
    return {slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", text, flags=re.M)}


def test_slug_matches_the_toc_extension():
    assert slug("MoE models and uneven pipelines") == "moe-models-and-uneven-pipelines"
    assert slug("Long responses: context parallelism and the fused log-prob head") == (
        "long-responses-context-parallelism-and-the-fused-log-prob-head"
    )


def test_readme_is_a_front_page_that_starts_with_the_two_commands():
    lines = README.read_text().splitlines()
    assert len(lines) <= 250
    assert lines[:5] == ["# rltrain", "", "```bash", lines[3], lines[4]]
    assert lines[3].startswith("make quickstart ") and lines[4].startswith("make test ")


def test_every_readme_link_names_an_existing_file_and_heading():
    links = LINK.findall(README.read_text())
    assert len(links) >= 15  # the feature table and the documentation list link into docs/
    for link in links:
        assert not link.startswith(("http://", "https://", "/")), link
        path, _, anchor = link.partition("#")
        target = ROOT / path
        assert target.is_file(), link
        if anchor:
            assert anchor in anchors(target), link


def test_anchors_of_a_page_by_hand(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("# Title\n\n```\n# not a heading\n```\n\n## Uneven pipeline stages, expert TP\n")
    assert anchors(page) == {"title", "uneven-pipeline-stages-expert-tp"}


def test_the_recipe_table_lists_every_recipe_and_nothing_else():
    recipes = ROOT / "recipes"
    shipped = {
        p.relative_to(recipes).as_posix()
        for p in recipes.rglob("*.yaml")
        if p.relative_to(recipes).parts[0] not in ("tools", "interactions") and not p.stem.endswith("_base")
    }
    table = (ROOT / "docs" / "configuration.md").read_text()
    listed = set(re.findall(r"^\| `([^`]+\.yaml)` \|", table, flags=re.M))
    assert "quickstart_cpu.yaml" in listed and "gpu/qwen2.5_7b_gsm8k_ppo.yaml" in listed
    assert listed == shipped
