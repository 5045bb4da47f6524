"""Every figure of p3d-plan or a dry run that README.md and docs/*.md quote, rerun and compared (issue 64, item 13):
the commands and how each figure is written are in tests/helpers/doc_figures.py. A failure names the page, the
command and the figure as it prints now."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.helpers.doc_figures import BLOCKS, QUOTES, run

ROOT = Path(__file__).resolve().parents[1].parent


def flat(page: str) -> str:
    """The page with its line breaks and runs of spaces as one space (prose wraps anywhere)."""
    return " ".join((ROOT / page).read_text().split())


@pytest.mark.parametrize(
    "quote",
    [pytest.param(q, id=f"{q.page}:{i}", marks=pytest.mark.slow if q.slow else ()) for i, q in enumerate(QUOTES)],
)
def test_a_quoted_figure_is_what_its_command_prints(quote):
    cfg, result = run(quote.command)
    text = flat(quote.page)
    for figure in quote.figures(cfg, result):
        assert " ".join(figure.split()) in text, f"{quote.page}: `{quote.command}` now gives: {figure}"


@pytest.mark.parametrize("block", BLOCKS, ids=[b.page for b in BLOCKS])
def test_a_quoted_output_block_is_what_its_command_prints(block):
    lines = (ROOT / block.page).read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if block.after in line) + 1
    while not lines[start].strip():
        start += 1
    shown = []
    for line in lines[start:]:
        if line.strip() and not line.startswith("      "):
            break
        shown.append(line[6:])
    while shown and not shown[-1]:
        shown.pop()
    printed = run(block.command)[1].render().splitlines()
    assert shown == printed, f"{block.page}: `{block.command}` now prints:\n" + "\n".join(printed)


@pytest.mark.slow
def test_the_published_runs_table_is_what_the_bench_prints():
    """docs/planner.md's table of published runs is `bench/planner.py published`'s output, line for line."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_planner", ROOT / "bench" / "planner.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    from tests.helpers import published

    printed = bench.table([bench.row(name) for name in published.ROWS]).splitlines()
    page = (ROOT / "docs/planner.md").read_text().splitlines()
    start = page.index(printed[0])
    assert page[start : start + len(printed)] == printed


OUTPUT = re.compile(r"^      (p3d-plan:|mesh=auto:|dry run:|dp_comm|memory per|heterogeneous plan|throughput:|  -> )")


def test_every_output_line_the_docs_show_is_rerun():
    """An output of p3d-plan or a dry run shown in a page (indented six spaces, as p3d-plan's lines are) is part of a
    block or a quote above, so that it is rerun: a new one cannot be pasted in unchecked."""
    for page in ("README.md", *sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))):
        shown = [line.strip() for line in (ROOT / page).read_text().splitlines() if OUTPUT.match(line)]
        if not shown:
            continue
        rerun = [line.strip() for b in BLOCKS if b.page == page for line in run(b.command)[1].render().splitlines()]
        rerun += [f for q in QUOTES if q.page == page and not q.slow for f in q.figures(*run(q.command))]
        for line in shown:
            assert line in rerun, f"{page}: `{line}` is not rerun: add it to tests/helpers/doc_figures.py"


def test_the_search_section_lists_what_the_search_tries():
    """docs/planner.md's mesh=auto section names the recompute modes and ZeRO stages p3d.planner.search tries (issue
    64, item 11: it said ZeRO-2/3 were not searched while the tables listed them)."""
    from p3d.planner.search import RECOMPUTE, ZERO_STAGES

    text = flat("docs/planner.md")
    assert f"recompute {' / '.join(RECOMPUTE)} and zero.stage {' / '.join(map(str, ZERO_STAGES))}" in text
    assert "not searched" not in text
