"""The docs name only what the checkout holds: every repository path that README.md and docs/*.md name exists,
every relative markdown link resolves inside the repository, and README.md stays a short page for users
(at most 250 lines, no link outside the repository)."""

from __future__ import annotations

import glob
import re
from pathlib import Path

import pytest

from tests.helpers.documented import CASES, documented_lines

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 250

# A path into the repository: a top-level folder of the checkout followed by a path, or one of its root files.
# Not preceded by a word character, '/', '.' or '-' (so site-packages/..., https://.../docs/..., .venv/... and
# p3d-train are not paths of ours); it ends at a space, a backtick, a quote, a bracket, ':' (a line number or a
# ::test node id) or ',' outside braces ({train,prepare}: both).
PREFIXES = ("p3d/", "tests/", "bench/", "docs/", "recipes/", "hydra_plugins/", ".ci/", "conf/")
ROOT_FILES = ("Makefile", "pyproject.toml", "requirements-cpu.txt")
PATH = re.compile(
    r"(?<![\w/.\-])("
    + "|".join(re.escape(p) for p in PREFIXES)
    + r")((?:[\w.*/<>\-]|\{[\w.,\-]*\})*)"
    + r"|(?<![\w/.\-])("
    + "|".join(re.escape(f) for f in ROOT_FILES)
    + r")(?![\w.\-])"
)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# Files that a command writes into the checkout and that a fresh clone does not hold.
WRITTEN = {"docs/gpu.md": "make gpu-check writes it on a machine with CUDA GPUs"}


def expand_braces(path: str) -> list[str]:
    """``recipes/slurm/{train,prepare}.sbatch`` -> both paths (one level of braces)."""
    found = re.search(r"\{([^{}]*)\}", path)
    if not found:
        return [path]
    return [
        p for alt in found.group(1).split(",") for p in expand_braces(path[: found.start()] + alt + path[found.end() :])
    ]


def named_paths(text: str) -> set[str]:
    """The repository paths a page names, without trailing punctuation; ``<run.dir>``-style placeholders and
    paths under them are not repository paths and are left out."""
    out = set()
    for m in PATH.finditer(text):
        token = m.group(0).rstrip(".,;:)'\"")
        if "<" in token or ">" in token:
            continue
        out.update(expand_braces(token))
    return out


def exists(path: str) -> bool:
    if any(c in path for c in "*?["):
        return bool(glob.glob(str(ROOT / path)))
    return (ROOT / path).exists()


def test_the_path_pattern_finds_paths_and_only_paths():
    text = (
        "see `p3d/train/faults.py`, tests/test_faults.py::test_x, bench/*.py and p3d/a.py:12. Also the Makefile, "
        "`<run.dir>/logs/`, p3d-train, p3d.cli.worker, .venv/lib/site-packages/torch/x.py, https://x.org/docs/y, "
        "recipes/slurm/{train,prepare}.sbatch"
    )
    assert named_paths(text) == {
        "p3d/train/faults.py",
        "tests/test_faults.py",
        "bench/*.py",
        "p3d/a.py",
        "Makefile",
        "recipes/slurm/train.sbatch",
        "recipes/slurm/prepare.sbatch",
    }


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_named_path_exists(page):
    missing = sorted(p for p in named_paths(page.read_text()) if not exists(p) and p not in WRITTEN)
    assert not missing, f"{page.relative_to(ROOT)} names paths the checkout does not hold: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves_inside_the_repository(page):
    bad = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):  # a URL, or an anchor on this page
            continue
        path = (page.parent / target.split("#", 1)[0]).resolve()
        if not path.is_relative_to(ROOT) or not path.exists():
            bad.append(target)
    assert not bad, f"{page.relative_to(ROOT)} links to what the repository does not hold: {bad}"


def test_the_readme_is_short_and_stays_inside_the_repository():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= README_MAX_LINES, "README.md is for users: move the detail to a docs/ page"
    assert "../" not in text, "README.md links outside the repository"


def test_the_written_files_are_written_by_what_the_docs_say():
    assert "docs/gpu.md" in (ROOT / "bench" / "gpu_check.py").read_text()


def test_every_documented_line_has_a_case():
    lines = documented_lines()
    assert len(lines) >= 30, lines  # the pattern still finds the docs' command lines
    missing = [f"{name}: {cmd}" for name, cmd in lines if cmd not in CASES]
    assert not missing, "documented command lines without a case in tests/helpers/documented.py:\n" + "\n".join(missing)
    stale = sorted(set(CASES) - {cmd for _, cmd in lines})
    assert not stale, f"cases for lines the docs no longer show: {stale}"
