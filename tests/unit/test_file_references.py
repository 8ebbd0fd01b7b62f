"""Every repository path that the docs, the README, or a comment or docstring cites exists.

A cited path starts with one of the repository's top-level folders (`common/engine/kv_cache.py`,
`docs/results/README.md`, `tests/unit/`); markdown links are read relative to their file. Only
comments and docstrings of Python files are read: a string in code may name a file that a run
creates.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOP = (
    "common|gateway|prefill_node|decode_node|colocated_node|loadgen|planner|pdserve|benchmarks"
    "|tests|docs|deploy|docker|\\.ci"
)
# a path starts a word (not inside a longer path or a URL) and ends on a name character
CITED = re.compile(rf"(?<![\w./$~-])(?:{TOP})/[\w./-]*[\w/]")
# files that a documented command writes, not files of the repository
WRITTEN = {"deploy/k8s/base/cluster.key"}  # `pdserve keygen` (README, Kubernetes)
PATTERN_TAIL = re.compile(r"[-_.]?[*{<[]")  # a glob or a placeholder
MD_LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")
CODE_FOLDERS = (
    "common", "gateway", "prefill_node", "decode_node", "colocated_node", "loadgen", "planner",
    "pdserve", "benchmarks", "tests",
)  # fmt: skip


def cited_paths(text: str) -> list[str]:
    """Repository paths in `text` (a glob or a placeholder is a pattern, not a file)."""
    found = []
    for match in CITED.finditer(text):
        path = match.group(0).rstrip(".")
        if PATTERN_TAIL.match(text, match.end()):  # `tests/e2e/test_*.py`, `run-<n>`
            continue
        found.append(path)
    return found


def markdown_links(text: str) -> list[str]:
    links = []
    for match in MD_LINK.finditer(text):
        target = match.group(1)
        if "://" in target or target.startswith(("mailto:", "/")):
            continue
        links.append(target)
    return links


def python_prose(source: str) -> str:
    """The comments and docstrings of a Python file, one string."""
    parts: list[str] = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            parts.append(tok.string)
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                parts.append(doc)
    return "\n".join(parts)


def exists(root: Path, path: str, here: Path | None = None) -> bool:
    """From the repository's root, or from a markdown file's own folder (a results page
    citing its study's files); a module may be cited without its `.py`."""
    bases = [root] if here is None else [root, here]
    return any((b / path).exists() or (b / f"{path}.py").exists() for b in bases)


def dead_references(root: Path) -> list[str]:
    """'file: path' for every cited path under `root` that does not exist."""
    dead = []
    docs = [root / "README.md", *sorted((root / "docs").rglob("*.md"))]
    for md in (p for p in docs if p.exists()):
        text = md.read_text(encoding="utf-8")
        for path in cited_paths(text):
            if path not in WRITTEN and not exists(root, path, md.parent):
                dead.append(f"{md.relative_to(root)}: {path}")
        for link in markdown_links(text):
            if not (md.parent / link).exists():
                dead.append(f"{md.relative_to(root)}: ({link})")
    for folder in CODE_FOLDERS:
        base = root / folder
        if not base.is_dir() or base.is_symlink():
            continue
        for py in sorted(base.rglob("*.py")):
            if any(part.startswith(".") for part in py.relative_to(root).parts):
                continue
            for path in cited_paths(python_prose(py.read_text(encoding="utf-8"))):
                if not exists(root, path):
                    dead.append(f"{py.relative_to(root)}: {path}")
    return dead


def test_every_cited_path_exists():
    dead = dead_references(ROOT)
    assert not dead, "references to files that do not exist:\n" + "\n".join(dead)


def test_a_dead_reference_is_found(tmp_path):
    """The check itself: a moved file's old path, cited by a doc, a link and a comment; URLs,
    globs, placeholders, temporary and output folders and dotted module paths are not cited."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "common" / "node").mkdir(parents=True)
    (tmp_path / "common" / "node" / "runtime.py").write_text(
        '"""Moved from common/node.py."""\n# see common/node/runtime.py and docs/guide.md\nx = 1\n'
    )
    (tmp_path / "README.md").write_text(
        "See `common/node/runtime.py`, common/supervisor.py and [the guide](docs/guide.md).\n"
        "Not files: https://x.org/common/a.py, tests/e2e/test_*.py, $OUT/tests/run.json,\n"
        "/tmp/common/x.py, pdserve.common.engine.kv_cache, docs/results/<study>.yaml.\n"
        "A link with an anchor: [the runtime](common/node/runtime.py#L3).\n"
    )
    (tmp_path / "docs" / "ops.md").write_text(
        "Relative to the file: [metrics](operations.md), [home](../README.md).\n"
    )
    assert sorted(dead_references(tmp_path)) == sorted(
        [
            "docs/ops.md: (operations.md)",
            "README.md: common/supervisor.py",
            "README.md: docs/guide.md",  # the link's target, as a path
            "README.md: (docs/guide.md)",  # and as a link
            "common/node/runtime.py: common/node.py",
            "common/node/runtime.py: docs/guide.md",
        ]
    )
