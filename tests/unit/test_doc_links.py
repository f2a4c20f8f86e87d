"""Every relative link in the Markdown pages (README, CHANGELOG, docs/, results/) points at a file
or folder that exists, so moving a page cannot leave a dead link behind; results/README.md names
every folder of records; pages stay short (README 200 lines, docs pages 300)."""
import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
README_MAX_LINES = 200
DOCS_MAX_LINES = 300


def _pages():
    pages = [os.path.join(ROOT, "README.md"), os.path.join(ROOT, "CHANGELOG.md")]
    pages += glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True)
    pages += glob.glob(os.path.join(ROOT, "results", "**", "*.md"), recursive=True)
    return sorted(p for p in pages if os.path.isfile(p))


def dead_links(path):
    """``[(line number, target)]`` of the relative links in ``path`` (outside code blocks) that do
    not resolve."""
    dead, code = [], False
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if line.lstrip().startswith("```"):
                code = not code
                continue
            if code:
                continue
            for target in LINK.findall(re.sub(r"`[^`]*`", "", line)):   # not inside inline code
                if re.match(r"^(https?:|mailto:|#)", target):
                    continue
                rel = target.split("#", 1)[0]
                if not os.path.exists(os.path.normpath(os.path.join(os.path.dirname(path), rel))):
                    dead.append((i, target))
    return dead


def test_every_relative_link_resolves():
    pages = _pages()
    assert len(pages) > 10
    bad = [f"{os.path.relpath(p, ROOT)}:{i}: {t}" for p in pages for i, t in dead_links(p)]
    assert not bad, "dead links:\n" + "\n".join(bad)


def test_the_check_sees_a_dead_link(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "there.md").write_text("x")
    page.write_text("[ok](there.md) [web](https://example.org) [anchor](#a)\n```\n[in code](nowhere.md)\n```\n"
                    "[gone](nowhere.md#part) `kernel[cfg](*args)`\n")
    assert dead_links(str(page)) == [(5, "nowhere.md#part")]


def test_pages_stay_short_enough_to_read():
    """The guide (README) stays at most 200 lines and every docs page at most 300: longer material,
    such as dated experiment narratives, belongs in results/ beside its records, and the history of
    the defaults in CHANGELOG.md."""
    too_long = []
    for path, limit in [(os.path.join(ROOT, "README.md"), README_MAX_LINES)] + [
            (p, DOCS_MAX_LINES) for p in glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True)]:
        with open(path, encoding="utf-8") as f:
            n = sum(1 for _ in f)
        if n > limit:
            too_long.append(f"{os.path.relpath(path, ROOT)}: {n} lines (at most {limit})")
    assert not too_long, too_long


def unindexed_folders(results):
    """The folders of ``results/e2e`` that ``results/README.md`` does not name as ``e2e/FOLDER/``:
    a record nobody can trace to its command."""
    with open(os.path.join(results, "README.md"), encoding="utf-8") as f:
        index = f.read()
    folders = sorted(d for d in os.listdir(os.path.join(results, "e2e"))
                     if os.path.isdir(os.path.join(results, "e2e", d)))
    return [d for d in folders if f"e2e/{d}/" not in index]


def test_every_results_folder_is_indexed(tmp_path):
    assert not unindexed_folders(os.path.join(ROOT, "results")), "add them to results/README.md"
    (tmp_path / "e2e" / "2026-01-01-a").mkdir(parents=True)
    (tmp_path / "e2e" / "2026-01-01-ab").mkdir()
    (tmp_path / "README.md").write_text("## `e2e/2026-01-01-ab/` (not `e2e/2026-01-01-a`)\n")
    assert unindexed_folders(str(tmp_path)) == ["2026-01-01-a"]
