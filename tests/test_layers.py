"""The layer contract of gateway/ and trainer/, checked on every module's imports (issue 37).

Each package may import its own modules and the layers BELOW it in its stack, never one above or beside it:

    gateway (top to bottom)  modules                               what it is
    -----------------------  ------------------------------------  ----------------------------------------------------
    command line             gateway.cli                           `trajgate`: serves gateway.app, launches the trainer
    composition root         gateway.app                           builds the state, dispatches ASGI to the surfaces
    pages                    gateway.ui                            the web UI (uses the runs API's checks and events)
    endpoints                gateway.api, gateway.edge             ordinary endpoints; Messages/Responses translators
    wiring, judge            gateway.http.deps, gateway.judge      the state object + request dependencies; the judge
    model call               gateway.proxy                         receive, attribute, admit, forward, relay, record
    recorder, upstream       gateway.recorder, gateway.upstream    spool/writer/peers; the vLLM client and replicas
    http plumbing            gateway.http                          errors, auth, limits, metrics, write coalescing
    store                    gateway.store                         the schema and every statement
    runs                     gateway.runs                          run config, run names, TRAJGATE_* settings

    trainer (top to bottom)  modules
    -----------------------  ------------------------------------
    demo                     trainer.demo                          `trajgate demo` and the vLLM CPU harness
    worker                   trainer.worker                        the trainer process: loop, publish, trackers
    algorithm                trainer (rest), trainer.backends      samples, loss, step, distributed, lora, checkpoint

Across the two stacks: the trainer imports only gateway.store and gateway.runs; the gateway imports the trainer only
from gateway.cli (which launches it). `gateway.http` sits in two places on purpose: its plumbing is under everything
that serves HTTP (the recorder's peer wait raises its errors), while `deps` knows the whole state object (proxy,
writer, peers) and so sits right under the endpoints that use it.

Imports are read with `ast`: module-level, function-level and `if TYPE_CHECKING:` ones alike, since a lazy or
type-only import is still a dependency. No two modules may form a cycle.

The tests have one rule of their own: nothing imports a test module (tests/**/test_*.py). A helper two test files
share lives in tests/support/, so that moving, renaming or deleting a test file never breaks another one.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("gateway", "trainer")

# Top to bottom, as in the table above.
GATEWAY_LAYERS = [
    ["gateway.cli"],
    ["gateway.app"],
    ["gateway.ui"],
    ["gateway.api", "gateway.edge"],
    ["gateway.http.deps", "gateway.judge"],
    ["gateway.proxy"],
    ["gateway.recorder", "gateway.upstream"],
    ["gateway.http"],
    ["gateway.store"],
    ["gateway.runs"],
]
TRAINER_LAYERS = [
    ["trainer.demo"],
    ["trainer.worker"],
    ["trainer"],
]
# What a unit may import from the other stack.
ACROSS = {
    "gateway.cli": ("trainer",),
    "trainer": ("gateway.store", "gateway.runs"),
}

Graph = dict[str, set[str]]


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, name: str, known: set[str], roots: tuple[str, ...] = PACKAGES) -> set[str]:
    """Every module of `known` under `roots` that `path` imports, wherever the import statement sits."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            # `from gateway.proxy import capture` imports the module gateway.proxy.capture
            for alias in node.names:
                found.add(f"{source}.{alias.name}" if f"{source}.{alias.name}" in known else source)
    return {target for target in found if target.split(".")[0] in roots and target in known}


def project_graph() -> Graph:
    paths = {module_name(path): path for package in PACKAGES for path in (ROOT / package).rglob("*.py")}
    known = set(paths)
    return {name: imports_of(path, name, known) - {name} for name, path in sorted(paths.items())}


def unit_of(module: str) -> tuple[str, str, int] | None:
    """(stack, unit, rank) of the longest table entry that contains `module`; None for the root packages."""
    best = None
    for stack, layers in (("gateway", GATEWAY_LAYERS), ("trainer", TRAINER_LAYERS)):
        for rank, units in enumerate(layers):
            for unit in units:
                if (module == unit or module.startswith(unit + ".")) and (best is None or len(unit) > len(best[1])):
                    best = (stack, unit, rank)
    return best


def contains(prefixes: tuple[str, ...], module: str) -> bool:
    return any(module == prefix or module.startswith(prefix + ".") for prefix in prefixes)


def violations(graph: Graph) -> list[str]:
    """Imports the table does not allow."""
    found = []
    for source, targets in sorted(graph.items()):
        placed = unit_of(source)
        if placed is None:
            continue
        stack, unit, rank = placed
        across = next((allowed for key, allowed in ACROSS.items() if contains((key,), source)), ())
        for target in sorted(targets):
            into = unit_of(target)
            if into is None:
                continue
            if into[0] != stack:
                ok = contains(across, target)
            else:
                ok = into[1] == unit or into[2] > rank
            if not ok:
                found.append(f"{source} ({unit}) imports {target} ({into[1]})")
    return found


def cycles(graph: Graph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


@pytest.fixture(scope="module")
def graph() -> Graph:
    return project_graph()


def test_every_module_has_a_layer(graph: Graph) -> None:
    assert [m for m in graph if unit_of(m) is None and m not in PACKAGES] == []


def test_imports_follow_the_layers(graph: Graph) -> None:
    assert violations(graph) == []


def test_no_import_cycles(graph: Graph) -> None:
    assert cycles(graph) == []


def test_no_two_modules_share_a_file_name() -> None:
    names = defaultdict(list)
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if path.name != "__init__.py":
                names[path.name].append(str(path.relative_to(ROOT)))
    assert {name: paths for name, paths in names.items() if len(paths) > 1} == {}


def test_no_module_imports_a_test_module() -> None:
    test_modules = {module_name(path) for path in (ROOT / "tests").rglob("test_*.py")}
    found = [
        f"{module_name(path)} imports {target}"
        for folder in ("tests", "bench", "scripts")
        for path in sorted((ROOT / folder).rglob("*.py"))
        for target in sorted(imports_of(path, module_name(path), test_modules, roots=("tests",)))
    ]
    assert not found, "move what they share into tests/support/:\n" + "\n".join(found)


# -- the checker itself, on made-up graphs ---------------------------------------------------------------------------


def test_the_checker_refuses_an_upward_import() -> None:
    graph = {"gateway.store.x": {"gateway.proxy.y"}, "gateway.proxy.y": set()}
    assert violations(graph) == ["gateway.store.x (gateway.store) imports gateway.proxy.y (gateway.proxy)"]


def test_the_checker_refuses_an_import_beside_it() -> None:
    assert violations({"gateway.api.a": {"gateway.edge.b"}}) == [
        "gateway.api.a (gateway.api) imports gateway.edge.b (gateway.edge)"
    ]


def test_the_checker_allows_downward_and_own_package_imports() -> None:
    graph = {
        "gateway.proxy.a": {"gateway.proxy.b", "gateway.store.c", "gateway.runs.d", "gateway.http.errors"},
        "gateway.http.deps": {"gateway.proxy.a", "gateway.http.auth"},
        "gateway.cli": {"trainer.worker.loop"},
        "trainer.worker.loop": {"trainer.loss", "gateway.store.db", "gateway.runs.settings"},
    }
    assert violations(graph) == []


def test_the_checker_keeps_the_stacks_apart() -> None:
    graph = {
        "gateway.app": {"trainer.loss"},
        "trainer.worker.loop": {"gateway.proxy.a"},
        "trainer.loss": {"trainer.worker.loop"},
    }
    assert violations(graph) == [
        "gateway.app (gateway.app) imports trainer.loss (trainer)",
        "trainer.loss (trainer) imports trainer.worker.loop (trainer.worker)",
        "trainer.worker.loop (trainer.worker) imports gateway.proxy.a (gateway.proxy)",
    ]


def test_the_checker_finds_cycles() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({**graph, "c": set()}) == []


def test_the_reader_sees_lazy_and_type_only_imports(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from gateway.proxy import hot_path\n"
        "def f():\n    import gateway.store.db\n    from gateway.runs.names import check_run_name\n"
    )
    known = {"gateway.proxy", "gateway.proxy.hot_path", "gateway.store.db", "gateway.runs.names"}
    assert imports_of(module, "m", known) == {"gateway.proxy.hot_path", "gateway.store.db", "gateway.runs.names"}


def test_the_reader_finds_a_test_module_however_it_is_imported(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text(
        "from tests.a.test_x import helper\n"
        "from tests.b import test_y\n"
        "def f():\n    import tests.c.test_z\n    from tests.support.shared import test_data\n"
    )
    known = {"tests.a.test_x", "tests.b.test_y", "tests.c.test_z"}
    assert imports_of(module, "tests.m", known, roots=("tests",)) == known
