"""The documentation stays true to the code: docs/flags.md is the page the settings table
generates (`kiln config docs`), the README stays short, and every link between the pages
leads to a file that exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kiln.cli.main import main as kiln_main
from kiln.i18n import msg
from kiln.settings import docs as setting_docs
from kiln.settings import table as C

ROOT = Path(__file__).resolve().parents[2]
FLAGS_MD = ROOT / "docs" / "flags.md"


def test_docs_flags_md_is_generated_from_the_current_settings_table() -> None:
    assert FLAGS_MD.exists(), "docs/flags.md is missing: run `kiln config docs`"
    assert FLAGS_MD.read_text() == setting_docs.flags_markdown(), (
        "docs/flags.md is stale (the settings table in kiln/settings/table.py changed): run "
        "`kiln config docs` and commit docs/flags.md")


def test_the_page_names_every_setting_with_its_flags_and_env_var() -> None:
    page = setting_docs.flags_markdown()
    rows = {line.split("|")[1].strip(): line for line in page.splitlines()
            if line.startswith("| `")}
    for s in C.SETTINGS:
        row = rows.get(f"`{s.name}`")
        assert row is not None, s.name
        assert f"`{s.env_var}`" in row, s.name
        for flag in (*s.flags, *s.neg_flags):
            assert f"`{flag}`" in row, (s.name, flag)
        assert s.affects in row, s.name
    # the front-end flags that are not rows come from kiln serve's parser
    for flag in ("--dry-run", "--effective-config-json", "--decision-trace-jsonl", "--config"):
        assert f"`{flag}`" in page, flag


def test_kiln_config_docs_writes_the_page_and_check_finds_it_stale(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "flags.md"
    assert kiln_main(["config", "docs", "--check", "--output", str(out)]) == 1  # absent
    assert kiln_main(["config", "docs", "--output", str(out)]) == 0
    assert out.read_text() == setting_docs.flags_markdown()
    assert kiln_main(["config", "docs", "--check", "--output", str(out)]) == 0
    out.write_text(out.read_text().replace("`--max-num-seqs`", "`--max-seqs`"))
    capsys.readouterr()
    assert kiln_main(["config", "docs", "--check", "--output", str(out)]) == 1
    printed = capsys.readouterr().out
    assert msg("docs.stale", path=out, command=setting_docs.COMMAND) in printed, printed
    assert kiln_main(["config", "docs", "--output", str(out)]) == 0
    assert kiln_main(["config", "docs", "--check", "--output", str(out)]) == 0


def _links(path: Path) -> list[tuple[str, str]]:
    """(file, anchor) of each relative link in a Markdown file ([text](target), images too);
    file "" is the page itself."""
    targets = re.findall(r"\]\(([^)\s]+)\)", path.read_text())
    parts = [t.partition("#") for t in targets if not re.match(r"[a-z]+:", t)]
    return [(file, anchor) for file, _, anchor in parts]


def _anchors(path: Path) -> set[str]:
    """GitHub's ids for a page's headings: lower case, punctuation dropped, spaces to hyphens."""
    heads = re.findall(r"^#+ (.+)$", path.read_text(), flags=re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in heads}


def test_readme_is_short_and_every_link_in_the_docs_leads_somewhere() -> None:
    readme = ROOT / "README.md"
    assert len(readme.read_text().splitlines()) <= 250, "README.md: at most 250 lines (issue 42)"
    pages = [readme, *sorted((ROOT / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        for target, anchor in _links(page):
            dest = (page.parent / target) if target else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{page.relative_to(ROOT)} -> {target}#{anchor}")
    assert not broken, broken
    linked = {(readme.parent / t).resolve() for t, _ in _links(readme) if t}
    unlinked = [p.name for p in pages[1:] if p.resolve() not in linked]
    assert not unlinked, f"docs pages the README does not link: {unlinked}"


def test_every_code_block_in_the_docs_is_closed() -> None:
    # An unclosed ``` turns the rest of the page into code: its headings (and the anchors the
    # README links to) vanish from the rendered page, which the link check above cannot see.
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    unclosed = [p.name for p in pages
                if sum(1 for line in p.read_text().splitlines()
                       if line.lstrip().startswith("```")) % 2]
    assert not unclosed, f"a ``` code block is left open in {unclosed}"
