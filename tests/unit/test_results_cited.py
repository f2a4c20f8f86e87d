"""Every file under results/ is evidence someone cites: a page of the guides, a test or a job names it,
or a cited record does, so a record nobody can reach from the guides cannot linger.

A citation is a ``results/...`` path (a file, or a folder, which cites everything under it; ``*``,
``[...]`` and ``{a,b}`` patterns as a shell reads them) or a relative Markdown link that resolves into
results/. The citers are README.md, docs/**/*.md, tests/**/*.py and jobs/**/*.py (test inputs and the
default paths a job reads). Citation is closed over the records: a cited text record (``.md``,
``.json``, ``.jsonl``, ``.txt``) cites the paths and links in it, so a summary keeps its inputs, and a
cited ``X.md`` cites its sibling folder ``X/``, the records its narrative describes. A path must name
something below a kind of record (``results/KIND/NAME``): ``results/`` or ``results/e2e`` alone names
the collection, not a record. results/README.md is the index of what is kept: always kept, never a
citer, and every folder it describes exists."""
import fnmatch
import pathlib
import re
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[2]
INDEX = ("results", "README.md")
#: a ``results/...`` path as prose, commands and code write it, with shell patterns
PATH = re.compile(r"(?<![A-Za-z0-9_\-])results/(?:[A-Za-z0-9_.\-/*]|\{[A-Za-z0-9_.\-/*,]*\}|\[[A-Za-z0-9\-]+\])+")
#: the target of a Markdown link, anchors and titles left off
LINK = re.compile(r"\]\(<?([^)#\s>]+)")
TEXT_RECORDS = {".md", ".json", ".jsonl", ".txt"}


def tracked_results(root):
    """The files under ``root/results`` as path-part tuples relative to ``root``: git's tracked files
    (those still on disk) in a checkout, the files on disk otherwise."""
    if (root / ".git").exists():
        out = subprocess.run(["git", "ls-files", "-z", "results"], cwd=root, capture_output=True,
                             text=True, check=True).stdout
        return {tuple(p.split("/")) for p in out.split("\0") if p and (root / p).is_file()}
    return {p.relative_to(root).parts for p in (root / "results").rglob("*") if p.is_file()}


def citers(root):
    """The files whose citations start the closure."""
    found = [root / "README.md"] + sorted((root / "docs").rglob("*.md"))
    for folder in ("tests", "jobs"):
        found += sorted((root / folder).rglob("*.py"))
    return [p for p in found if p.is_file()]


def _expand(pattern):
    """``pattern`` with its ``{a,b}`` groups expanded, as a shell would."""
    m = re.search(r"\{([^{}]*)\}", pattern)
    if not m:
        return [pattern]
    return [e for alt in m.group(1).split(",") for e in _expand(pattern[:m.start()] + alt + pattern[m.end():])]


def _parts(path):
    """``path`` (relative to the root, ``/``-separated) as normalised parts, or None outside it."""
    parts = []
    for part in path.split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            if not parts:
                return None
            parts.pop()
        else:
            parts.append(part)
    return tuple(parts)


def references(text, where, root):
    """The patterns (part tuples relative to ``root``) that ``text``, the contents of the file at
    ``where``, cites: its ``results/`` paths and the relative links that resolve into results/."""
    found = set()
    for m in PATH.finditer(re.sub(r"[a-z]+://\S+", " ", text)):
        for path in _expand(m.group(0).rstrip(".-")):
            found.add(_parts(path))
    base = where.parent.relative_to(root).as_posix()
    for m in LINK.finditer(text):
        target = m.group(1)
        if re.match(r"^[a-z]+:", target):
            continue
        found.add(_parts(base + "/" + target))
    return {p for p in found if p and p[0] == "results" and len(p) >= 3}


def _matches(pattern, parts):
    """Whether the file ``parts`` is, or lies under, what ``pattern`` names."""
    return len(parts) >= len(pattern) and all(fnmatch.fnmatchcase(f, p) for f, p in zip(parts, pattern))


def cited(root, files, sources):
    """The members of ``files`` (part tuples) that ``sources`` (paths of citing files) cite, directly
    or through the cited records' own citations and the sibling folders of cited narratives."""
    pending = set()
    for path in sources:
        pending |= references(path.read_text(encoding="utf-8", errors="replace"), path, root)
    done, kept = set(), set()
    while pending:
        pattern = pending.pop()
        if pattern in done:
            continue
        done.add(pattern)
        for parts in files - kept:
            if not _matches(pattern, parts):
                continue
            kept.add(parts)
            path = root.joinpath(*parts)
            if path.suffix in TEXT_RECORDS and parts != INDEX:
                pending |= references(path.read_text(encoding="utf-8", errors="replace"), path, root)
            if path.suffix == ".md":
                pending.add(parts[:-1] + (parts[-1][:-len(".md")],))
    return kept | ({INDEX} & files)


def uncited(root):
    """The files under ``root/results`` that nothing cites, as ``/``-joined paths."""
    files = tracked_results(root)
    return sorted("/".join(p) for p in files - cited(root, files, citers(root)))


def undescribable(root):
    """What results/README.md describes that does not exist: the folders its headings name
    (``KIND/NAME/``, relative to results/) and the ``results/`` paths it names that match no file."""
    index = root.joinpath(*INDEX)
    text = index.read_text(encoding="utf-8")
    files = tracked_results(root)
    missing = []
    for line in text.splitlines():
        if line.startswith("#"):
            missing += [f for f in re.findall(r"`([^`\s]+/)`", line)
                        if not any(_matches(_parts("results/" + f), parts) for parts in files)]
    for pattern in sorted(references(text, index, root)):
        if not any(_matches(pattern, parts) for parts in files):
            missing.append("/".join(pattern))
    return missing


def test_every_record_is_cited():
    assert not uncited(ROOT), "cite them from the guides, or remove them"


def test_the_index_describes_only_what_exists():
    assert not undescribable(ROOT)


def _tree(tmp_path, files):
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_an_uncited_record_is_found(tmp_path):
    root = _tree(tmp_path, {
        "README.md": "Figures: [the run](results/e2e/run.md); `results/e2e/` is not a record.\n",
        "docs/page.md": "Logs in `results/bench/2026-01-01/`.\n",
        "jobs/job.py": 'DEFAULT = "results/bits/P{2,4}.jsonl"\n',
        "results/README.md": "## `e2e/orphan/`: the index names it, which does not cite it\n",
        "results/e2e/run.md": "The narrative.\n",
        "results/e2e/run/e2e.jsonl": "{}\n",
        "results/bench/2026-01-01/a.log": "",
        "results/bits/P2.jsonl": "", "results/bits/P4.jsonl": "", "results/bits/P8.jsonl": "",
        "results/e2e/orphan/e2e.jsonl": "{}\n",
    })
    assert uncited(root) == ["results/bits/P8.jsonl", "results/e2e/orphan/e2e.jsonl"]
    (root / "results/e2e/orphan/e2e.jsonl").unlink()
    (root / "results/bits/P8.jsonl").unlink()
    assert uncited(root) == []
    assert undescribable(root) == ["e2e/orphan/"]


def test_a_cited_record_keeps_its_inputs(tmp_path):
    root = _tree(tmp_path, {
        "docs/page.md": "[summary](../results/e2e/report/summary.md)\n",
        "results/README.md": "",
        "results/e2e/report/summary.md": "From [the runs](../runs/) and the rates of "
                                         "`results/e2e/tune/tuned.json`.\n",
        "results/e2e/runs/s1/e2e.jsonl": '{"tuned": "results/e2e/older/tuned.json"}\n',
        "results/e2e/tune/tuned.json": "{}\n",
        "results/e2e/tune/e2e.jsonl": "{}\n",
        "results/e2e/older/tuned.json": "{}\n",
    })
    assert uncited(root) == ["results/e2e/tune/e2e.jsonl"]
    (root / "results/e2e/report/summary.md").write_text("Rates of `results/e2e/tune/tuned.json`.\n")
    assert uncited(root) == ["results/e2e/older/tuned.json", "results/e2e/runs/s1/e2e.jsonl",
                             "results/e2e/tune/e2e.jsonl"]


def test_the_index_is_not_a_citer(tmp_path):
    root = _tree(tmp_path, {
        "README.md": "",
        "results/README.md": "## `e2e/run/`\n`results/e2e/run/e2e.jsonl`, `results/e2e/gone/e2e.jsonl`\n",
        "results/e2e/run/e2e.jsonl": "{}\n",
    })
    assert uncited(root) == ["results/e2e/run/e2e.jsonl"]
    assert undescribable(root) == ["results/e2e/gone/e2e.jsonl"]


def test_patterns_and_links_resolve_as_a_shell_and_a_browser_would():
    where = ROOT / "docs" / "page.md"
    refs = references("`results/e2e/2001-01-0[12]-x/*/e2e.jsonl` results/e2e/{a,b}/t.json. "
                      "[x](../results/gpu/run/) [y](https://example.org/results/x/y) [z](other.md) "
                      "`results/e2e`", where, ROOT)
    assert refs == {("results", "e2e", "2001-01-0[12]-x", "*", "e2e.jsonl"),
                    ("results", "e2e", "a", "t.json"), ("results", "e2e", "b", "t.json"),
                    ("results", "gpu", "run")}
    assert _matches(("results", "e2e", "2001-01-0[12]-x", "*", "e2e.jsonl"),
                    ("results", "e2e", "2001-01-02-x", "lm", "e2e.jsonl"))
    assert not _matches(("results", "e2e", "2001-01-0[12]-x"), ("results", "e2e", "2001-01-03-x", "e2e.jsonl"))
    assert not _matches(("results", "e2e", "a"), ("results", "e2e", "ab", "t.json"))
