"""The layers are enforced, not described: each half's rooms import only downward, no module imports itself back
through others, and the runtime reads the planner only through the contract and the cost-model users named here
(docs/CONTRIBUTING.md, "Where things are"). Function-level imports count: grimp reads every import statement."""

import functools

import grimp
import pytest

PLANNER_LAYERS = (
    "planner.adapt",
    grimp.Layer("planner.cli", "planner.analysis", "planner.calibrate", "planner.replan"),
    "planner.arguments",
    "planner.api",
    grimp.Layer("planner.plan_document", "planner.trace"),
    "planner.search",
    "planner.problem",
    "planner.inputs",
    "planner.profiles",
    grimp.Layer("planner.dataset", "planner.catalog"),
    "planner.cost",
    "planner.contract",
)
"""The planner, top to bottom: a layer imports only the layers below it; the rooms of one layer not each other."""

RUNTIME_LAYERS = (
    "runtime.__main__",
    grimp.Layer("runtime.dry_run", "runtime.export", "runtime.profile"),
    "runtime.launch",
    "runtime.training",
    "runtime.models",
    grimp.Layer("runtime.data", "runtime.checkpoints", "runtime.observability"),
    "runtime.parallel",
    "runtime.run",
)
"""The runtime, top to bottom."""

RUNTIME_READS_OF_THE_PLANNER = {
    "planner.contract": ("runtime",),
    "planner.cost": ("runtime.data", "runtime.training", "runtime.dry_run"),
    "planner.profiles": ("runtime.profile",),
    "planner.catalog": ("runtime.profile",),
}
"""What of the planner the runtime may import, and from where: the contract anywhere; the cost model where it runs
(the balancer of a dataset plan's packs and step inputs, the dry-run report); the profiles and the catalog in the
profiler, which writes and compares profiles (calibration, which plans, is the planner's own command)."""


@functools.cache
def _graph() -> grimp.ImportGraph:
    """The import graph of both halves and what they import."""
    return grimp.build_graph("planner", "runtime", include_external_packages=True, cache_dir=None)


def _upward_imports(layers) -> list[str]:
    return sorted(f"{' -> '.join([head, *route.middle, tail])}"
                  for dep in _graph().find_illegal_dependencies_for_layers(layers=layers)
                  for route in dep.routes for head in route.heads for tail in route.tails)


@pytest.mark.parametrize("layers", [PLANNER_LAYERS, RUNTIME_LAYERS], ids=["planner", "runtime"])
def test_rooms_import_only_downward(layers):
    assert _upward_imports(layers) == []


def test_every_module_sits_in_a_layer():
    graph = _graph()
    for half, layers in (("planner", PLANNER_LAYERS), ("runtime", RUNTIME_LAYERS)):
        rooms = {name for layer in layers for name in (layer.module_tails if isinstance(layer, grimp.Layer)
                                                       else {layer})}
        loose = sorted(m for m in graph.find_descendants(half)
                       if not any(m == room or m.startswith(room + ".") for room in rooms))
        assert loose == [], f"{half}: modules outside every layer"


def _strongly_connected(modules: set[str], edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of the import graph restricted to ``modules``."""
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for target in edges[module]:
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while not component or component[-1] != module:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            components.append(sorted(component))

    for module in sorted(modules):
        if module not in index:
            visit(module)
    return components


def test_no_import_circles():
    graph = _graph()
    modules = graph.find_descendants("planner") | graph.find_descendants("runtime") | {"planner", "runtime"}
    edges = {m: graph.find_modules_directly_imported_by(m) & modules for m in modules}
    assert [c for c in _strongly_connected(modules, edges) if len(c) > 1] == []


def test_runtime_reads_only_the_contract_and_the_named_cost_model_users():
    graph = _graph()
    strays = []
    for module in sorted(graph.find_descendants("runtime") | {"runtime"}):
        for target in sorted(graph.find_modules_directly_imported_by(module)):
            if not target.startswith("planner"):
                continue
            allowed = [users for room, users in RUNTIME_READS_OF_THE_PLANNER.items()
                       if target == room or target.startswith(room + ".")]
            if not any(module == u or module.startswith(u + ".") for users in allowed for u in users):
                strays.append(f"{module} -> {target}")
    assert strays == []


@pytest.mark.parametrize(("half", "heavy"), [("planner", ("torch", "ray", "transformers")), ("runtime", ("ortools",))])
def test_no_heavy_imports_anywhere_in_a_half(half, heavy):
    """The planner never imports torch, ray or transformers, the runtime never OR-Tools: not directly, not through
    another module, not inside a function."""
    graph = _graph()
    chains = [graph.find_shortest_chain(importer=half, imported=name, as_packages=True)
              for name in heavy if name in graph.modules]
    assert [chain for chain in chains if chain] == []


def test_strongly_connected_finds_a_circle():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert [c for c in _strongly_connected(set(edges), edges) if len(c) > 1] == [["a", "b", "c"]]
