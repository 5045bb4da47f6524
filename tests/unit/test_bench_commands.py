"""Every bench command line the docs show, and every usage line of a bench script's docstring, is one its script
accepts: the script's own parser reads it (in this process, nothing runs), so that a renamed command or option cannot
leave a figure naming a command that no longer prints it. The benches themselves are not tests (minutes of timing on a
shared machine); docs/benchmarks.md gives the map of scripts and commands."""

from __future__ import annotations

import importlib
import re
import shlex
from pathlib import Path

import pytest

from tests.helpers.documented import PAGES

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
# a bench script run by python, anywhere in a line: `.venv/bin/python bench/cp.py runs --cp 1 2  # comment`
COMMAND = re.compile(r"python (bench/(\w+)\.py(?: [^#`\n]*)?)")
SCRIPTS = sorted(p.stem for p in BENCH.glob("*.py") if not p.stem.startswith(("_", "gpu_")))


def script(name: str):
    return importlib.import_module(f"bench.{name}")


def command_lines() -> list[tuple[str, str]]:
    """(where, command) for every bench command in a code block of README.md and docs/*.md (indented), and in the
    usage lines of the bench scripts' docstrings."""
    found = []
    texts = [(page, (ROOT / page).read_text()) for page in PAGES]
    texts += [(f"bench/{name}.py", script(name).__doc__ or "") for name in SCRIPTS]
    for where, text in texts:
        for line in text.splitlines():
            if line.startswith("    "):
                found += [(where, m.group(1).strip()) for m in COMMAND.finditer(line)]
    return found


def parsed(command: str):
    """The script's options for ``command`` (``bench/<name>.py ...``), as its ``main`` reads them."""
    path, *argv = shlex.split(command)
    module = script(Path(path).stem)
    argv = module.command_line(argv) if hasattr(module, "command_line") else argv
    return module.parser().parse_args(argv)


LINES = command_lines()


def test_the_docs_and_the_scripts_show_bench_commands():
    pages = {where for where, _ in LINES}
    assert "docs/benchmarks.md" in pages and "docs/context.md" in pages, pages
    assert {f"bench/{name}.py" for name in SCRIPTS} <= pages, "a bench script's docstring shows no usage line"


@pytest.mark.parametrize(("where", "command"), LINES, ids=[f"{w}: {c}" for w, c in LINES])
def test_a_shown_bench_command_is_one_its_script_accepts(where, command):
    assert (ROOT / command.split()[0]).is_file(), f"{where} names {command.split()[0]}, which bench/ does not hold"
    try:
        parsed(command)
    except SystemExit as exc:  # argparse's refusal: usage and the error on stderr, exit 2
        raise AssertionError(f"{where}: `{command}` is refused by its script's parser") from exc


def test_make_bench_runs_the_plain_comparison():
    """`make bench` runs bench/overhead.py bare: the comparison with the plain loop, with its defaults."""
    recipe = (ROOT / "Makefile").read_text().split("\nbench:", 1)[1].splitlines()[1]
    assert recipe.split()[-1] == "bench/overhead.py"
    args = parsed("bench/overhead.py")
    assert (args.command, args.steps, args.rounds) == ("plain", 10, 4)


def test_every_subcommand_has_a_shown_usage_line():
    """Each command of every script appears in a usage line of the script's docstring."""
    for name in SCRIPTS:
        braces = re.search(r"\{([\w,-]+)\}", script(name).parser().format_usage())  # usage: cp.py [-h] {a,b} ...
        names = set(braces.group(1).split(",")) if braces else set()
        shown = {parsed(c).command for w, c in LINES if w == f"bench/{name}.py" and hasattr(parsed(c), "command")}
        assert names <= shown, f"bench/{name}.py: no usage line for {sorted(names - shown)}"
