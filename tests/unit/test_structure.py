"""The shape of the code base: an acyclic import graph, imports that run down the declared layers (issue 32), the
architecture page that lists them, no library module importing the entry points, a run spec that keeps every
option (issue 10)."""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

from tests.helpers.runs import ROOT, compose

PACKAGE = ROOT / "p3d"


def _module_name(path: Path, package: Path) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the modules of ``package`` it imports anywhere in its body: at module level, inside a function, and
    under ``if TYPE_CHECKING:`` too (issue 50: report.py and report_plot.py imported each other, one of them only for
    the type checker, and a graph that left those imports out saw no cycle; such a cycle still ties the two files
    together, and it breaks the moment the annotation is evaluated).

    ``from p3d.a import b`` counts as an import of ``p3d.a.b`` when that is a module, else of ``p3d.a``; a relative
    import is resolved against the importing module's package."""
    top = package.name
    modules = {_module_name(p, package): p for p in package.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]  # the importing package
        deps: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name.split(".")[0] == top}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # from . import x, from ..a import b
                    base = ".".join(here[: len(here) - node.level + 1] + ([base] if base else []))
                if base.split(".")[0] != top:
                    continue
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    deps.add(sub if sub in modules else base)
        graph[name] = {d for d in deps if d in modules and d != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                return stack[stack.index(dep) :] + [dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_find_cycle_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_import_graph_counts_every_kind_of_import(tmp_path):
    """A cycle made of a function-local import, a relative one or one the type checker alone reads is a cycle."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    for f in ("__init__.py", "sub/__init__.py", "plain.py"):
        (pkg / f).write_text("")
    (pkg / "rows.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.plot import x\n")
    (pkg / "plot.py").write_text("def plot():\n    from pkg.rows import Row\n")
    (pkg / "sub" / "a.py").write_text("from . import b\nfrom ..plain import y\nimport os\n")
    (pkg / "sub" / "b.py").write_text("import pkg.sub.a\n")
    graph = import_graph(pkg)
    assert graph["pkg.rows"] == {"pkg.plot"} and graph["pkg.plot"] == {"pkg.rows"}
    assert graph["pkg.sub.a"] == {"pkg.sub.b", "pkg.plain"} and graph["pkg.sub.b"] == {"pkg.sub.a"}
    assert find_cycle(graph) == ["pkg.plot", "pkg.rows", "pkg.plot"]


def test_p3d_imports_form_a_tree():
    """No two files of p3d import each other, directly or through others, by any kind of import."""
    graph = import_graph()
    assert len(graph) > 40 and graph["p3d.planner.search"] >= {"p3d.planner.predict"}
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


# The declared order of the layers, top first (docs/architecture.md explains each): a module may import its own
# room and the rooms below it, never one above, at package level or inside a function. ``p3d.pipeline``
# sits above ``p3d.model`` (it cuts the model into stages), which sits above ``p3d.parallel`` (the model's blocks are
# built of the tensor-parallel layers).
LAYERS = (
    "p3d.cli",
    "p3d.launch",
    "p3d.jobs",
    "p3d.train",
    "p3d.hf",
    "p3d.checkpoint",
    "p3d.planner",
    "p3d.pipeline",
    "p3d.model",
    "p3d.parallel",
    "p3d.data",
    "p3d.rundir",
    "p3d.layout",
    "p3d.config",
    "p3d.compat",
    "p3d.console",
    "p3d.exit_codes",
)


def layer_of(module: str) -> int:
    """The index in LAYERS of the most specific room holding ``module``."""
    rooms = [i for i, room in enumerate(LAYERS) if module == room or module.startswith(room + ".")]
    assert rooms or module == "p3d", f"{module} is in no room of LAYERS"
    return max(rooms, key=lambda i: len(LAYERS[i])) if rooms else len(LAYERS)


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{m} ({LAYERS[layer_of(m)]}) imports {d} ({LAYERS[layer_of(d)]})"
        for m, deps in graph.items()
        for d in deps
        if layer_of(d) < layer_of(m)
    )


def test_the_layering_check_catches_an_upward_import():
    assert upward_imports({"p3d.data.loader": {"p3d.train.loop"}, "p3d.train.loop": set()}) == [
        "p3d.data.loader (p3d.data) imports p3d.train.loop (p3d.train)"
    ]
    assert upward_imports({"p3d.pipeline.specs": {"p3d.model.llama"}, "p3d.model.llama": {"p3d.parallel.tp"}}) == []
    assert upward_imports({"p3d.model.llama": {"p3d.pipeline.specs"}}) != []


def room_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The imports between the top-level rooms (p3d.parallel, p3d.model, ...): a room imports another when any of
    its modules imports one of the other's."""

    def room(module: str) -> str:
        return ".".join(module.split(".")[:2])

    rooms: dict[str, set[str]] = {}
    for m, deps in graph.items():
        rooms.setdefault(room(m), set()).update(room(d) for d in deps if room(d) != room(m))
    return rooms


def test_the_rooms_import_each_other_one_way():
    """Issue 64, item 25: p3d/parallel/pipeline built the model's stages (it imported p3d.model) while p3d.model's
    blocks import p3d.parallel's TP layers: the rooms parallel and model imported each other. No two rooms do."""
    assert find_cycle(
        room_graph({"p3d.parallel.pipeline.specs": {"p3d.model.llama"}, "p3d.model.llama": {"p3d.parallel.tp"}})
    )
    cycle = find_cycle(room_graph(import_graph()))
    assert cycle is None, "rooms that import each other: " + " -> ".join(cycle)


def test_imports_run_down_the_declared_layers():
    """Issue 32: lower layers reached up (dist/slurm_job -> launch, data/prepare_store -> launch, ...), and with
    function-local imports counted 17 packages formed one strongly connected set."""
    graph = import_graph()
    assert all(layer_of(m) is not None for m in graph)  # every module is in a room
    assert upward_imports(graph) == []


def test_the_architecture_page_lists_the_layers_in_order():
    text = (ROOT / "docs" / "architecture.md").read_text()
    listed = re.findall(r"^\s+(p3d(?:\.[a-z_]+)*)/?\s", text.split("## Layers", 1)[1].split("\n## ", 1)[0], re.M)
    assert tuple(m.replace("/", ".") for m in listed) == LAYERS, listed


def test_no_library_module_imports_the_cli():
    offenders = sorted(
        m
        for m, deps in import_graph().items()
        if not m.startswith("p3d.cli") and any(d.startswith("p3d.cli") for d in deps)
    )
    assert offenders == []


# The checkout's top level as specified (issue 50): the groups and recipes are links into the package, which the wheel
# ships (tests/e2e/test_wheel.py).
TOP_LEVEL = ("pyproject.toml", "README.md", "conf", "p3d", "recipes", "tests", "Makefile")


def test_the_checkout_has_its_specified_top_level():
    from p3d.config.shipped import conf_dir, package_root

    missing = [name for name in TOP_LEVEL if not (ROOT / name).exists()]
    assert missing == [], f"the checkout's top level lacks {missing}"
    for link, target in (("conf", conf_dir()), ("recipes", package_root() / "recipes")):
        path = ROOT / link
        assert path.is_symlink() and not Path(os.readlink(path)).is_absolute(), (
            f"{link}/: a relative link, valid in a clone"
        )
        assert path.resolve() == target.resolve(), f"{link}/ -> {path.resolve()}, not the shipped {target}"
    groups = {"model", "mesh", "schedule", "zero", "cluster", "data", "logger", "hydra"}
    assert (ROOT / "conf" / "config.yaml").is_file() and groups <= {p.name for p in (ROOT / "conf").iterdir()}


def test_plan_options_survive_the_run_spec(tmp_path):
    """``plan.*`` (the planner's options) and the derived run plan are both in run_spec.yaml, apart."""
    from p3d.launch.check import prepare
    from p3d.rundir.spec import read_spec, write_spec

    node = compose(
        "plan.force=true",
        "plan.efficiency=0.37",
        "plan.overlap_tp=true",
        "plan.overlap_dp=true",
        "plan.flash_attention=false",
        "plan.top=7",
        "mesh=tp2_pp2",
        run_dir=str(tmp_path),
    )
    cfg, plan = prepare(node)
    write_spec(cfg, plan, tmp_path)
    back, back_plan = read_spec(tmp_path)
    assert (
        back.plan.force,
        back.plan.efficiency,
        back.plan.overlap_tp,
        back.plan.overlap_dp,
        back.plan.flash_attention,
        back.plan.top,
    ) == (True, 0.37, True, True, False, 7)
    assert back.plan == cfg.plan and back_plan == plan and (back_plan.tp, back_plan.pp) == (2, 2)
