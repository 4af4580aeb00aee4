"""The docs say only what the tree has: every repository path or module named in backticks in
README.md and docs/**/*.md exists (a `module:Name` or `module.attr` also names something in that
file), every relative link resolves, shell lines run as shown from the repo root in a new terminal
(tools of the venv by their `.venv/bin/` path), a measurement JSON that is not committed says so
where it is named, and the README stays short (≤ 250 lines).

Ignores: paths outside the repository (`/tmp/...`, `~/...`, `.bench/...` outputs, URLs) and the
outputs a command writes (`--json X`, `--out X`)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 250
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
# the repository's own top-level names: a token starting with one of them names something here
TOP = {p.name for p in ROOT.iterdir() if not p.name.startswith(".") and p.name not in ("build", "out")}
PACKAGES = {name for name in TOP if (ROOT / name / "__init__.py").is_file()}
OUTPUT_FLAGS = {"--json", "--out", ">", "-o"}
VENV_TOOLS = {"specserve", "serve", "ray", "python", "python3", "pytest", "pip"}
MEASUREMENT_JSON = "docs/measurements/"
NOT_COMMITTED = "not committed"
FENCE = re.compile(r"^\s*```(\w*)")
INLINE = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
SPLIT = re.compile(r"[\s,;()\[\]|\"'=]+")


def _doc_id(path: Path) -> str:
    return str(path.relative_to(ROOT))


def code_lines(path: Path):
    """(line number, text, fence language or None for an inline span) of every backticked text."""
    lang = None
    for n, line in enumerate(path.read_text().splitlines(), 1):
        fence = FENCE.match(line)
        if fence:
            lang = None if lang is not None else (fence.group(1) or "text")
            continue
        if lang is not None:
            yield n, line, lang
        else:
            for span in INLINE.findall(line):
                yield n, span, None


def tokens(text: str):
    """Path-like words of a code text, skipping what follows an output flag."""
    words = [w for w in SPLIT.split(text) if w]
    for prev, word in zip([""] + words, words):
        if prev in OUTPUT_FLAGS:
            continue
        yield word.split("::")[0].rstrip(".:,;")


def _module_target(token: str) -> tuple[Path, list[str]] | None:
    """`pkg.mod[.attr][:Name]` → (file, names it must define), or None when no prefix is a module."""
    dotted, _, obj = token.partition(":")
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:i])
        for f in (base.with_suffix(".py"), base / "__init__.py"):
            if f.is_file():
                return f, parts[i:i + 1] + ([obj] if obj else [])
    return None


def problems_of(token: str, line: str) -> str | None:
    if "/" in token:
        first = token.split("/")[0]
        if first not in TOP or any(c in token for c in "*{}<>$"):
            return None
        if token.startswith(MEASUREMENT_JSON) and token.endswith(".json"):
            exists = (ROOT / token).is_file()
            if not exists and NOT_COMMITTED not in line:
                return f"{token}: missing, and the line does not say '{NOT_COMMITTED}'"
            if exists and NOT_COMMITTED in line:
                return f"{token}: committed, but the line still says '{NOT_COMMITTED}'"
            return None
        return None if (ROOT / token).exists() else f"{token}: no such path"
    if "." in token and token.split(".")[0] in PACKAGES and re.fullmatch(r"[\w.]+(:\w+)?", token):
        target = _module_target(token)
        if target is None:
            return f"{token}: no such module"
        file, names = target
        text = file.read_text()
        missing = [n for n in names if not re.search(rf"\b{re.escape(n)}\b", text)]
        return f"{token}: {', '.join(missing)} not in {_doc_id(file)}" if missing else None
    return None


@pytest.mark.parametrize("doc", DOCS, ids=_doc_id)
def test_named_paths_and_modules_exist(doc):
    bad = []
    for n, text, _ in code_lines(doc):
        line = doc.read_text().splitlines()[n - 1]
        bad += [f"{_doc_id(doc)}:{n}: {p}" for t in tokens(text) if (p := problems_of(t, line))]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("doc", DOCS, ids=_doc_id)
def test_relative_links_resolve(doc):
    bad = []
    for n, line in enumerate(doc.read_text().splitlines(), 1):
        for target in LINK.findall(line):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            if not (doc.parent / target.split("#")[0]).exists():
                bad.append(f"{_doc_id(doc)}:{n}: link {target}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("doc", DOCS, ids=_doc_id)
def test_shell_lines_run_from_the_repo_root_in_a_new_terminal(doc):
    """Nothing activates the venv: its tools are written `.venv/bin/<tool>` (or a make target)."""
    bad = []
    for n, text, lang in code_lines(doc):
        if lang not in ("bash", "sh", "shell"):
            continue
        words = text.split()
        while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):  # VAR=value before the command
            words = words[1:]
        if words and words[0] in VENV_TOOLS:
            bad.append(f"{_doc_id(doc)}:{n}: {text.strip()}")
    assert not bad, "write .venv/bin/<tool>:\n" + "\n".join(bad)


def test_readme_is_short():
    n = len((ROOT / "README.md").read_text().splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines; move detail into docs/"


def test_the_checks_catch_what_they_claim(tmp_path):
    """The checker itself: a renamed file, a missing module name, an unflagged JSON are caught."""
    assert problems_of("cluster/no_such_file.py", "") == "cluster/no_such_file.py: no such path"
    assert problems_of("tests/test_docs.py", "") is None
    assert problems_of("tests.test_docs:problems_of", "") is None
    assert "not in" in problems_of("cluster.cli:NoSuchThing", "")
    assert "not in cluster/__init__.py" in problems_of("cluster.no_such_module", "")
    assert problems_of("nothere.module", "") is None  # not this repository's package
    assert "does not say" in problems_of("docs/measurements/nope.json", "see `docs/measurements/nope.json`")
    assert problems_of("docs/measurements/nope.json", "JSON not committed") is None
    assert list(tokens("specserve bench decode --json docs/measurements/x.json cluster/bench/")) == [
        "specserve", "bench", "decode", "--json", "cluster/bench/"]
