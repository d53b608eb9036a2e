"""No new import cycles in the library: the import graph of every installed module, drawn with `ast` through
setup.py's mapping (asyncrl.<part> is the folder <part>: the package is not on disk as asyncrl/), has no strongly
connected component.

A cycle through imports inside functions runs without error, but it ties two modules so that neither can be read,
tested or moved alone, so those count too (each edge says whether it is lazy). `from a.b import c` is an edge to
the module a.b.c when c is a module, else to a.b. Run this file as a script to print the graph's cycles.
"""
import ast
import os
import sys
from collections import defaultdict

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def installed_parts() -> list[str]:
    """The PARTS list literal of setup.py: the top-level folders installed as asyncrl.<folder>."""
    tree = ast.parse(open(os.path.join(REPO, "setup.py")).read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "PARTS" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("setup.py has no PARTS list")


def library_modules() -> dict:
    """asyncrl module name -> file path, for every .py file under an installed part."""
    modules = {}
    for part in installed_parts():
        for root, dirs, files in os.walk(os.path.join(REPO, part)):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            for name in files:
                if not name.endswith(".py"):
                    continue
                path = os.path.relpath(os.path.join(root, name), REPO)
                dotted = path[:-3].replace(os.sep, ".")
                modules["asyncrl." + dotted.removesuffix(".__init__")] = path
    return modules


def import_edges(path: str, known: set) -> list[tuple[str, bool]]:
    """(imported asyncrl module, whether the import sits inside a function) for every import in the file."""
    edges = []

    def target(name: str) -> str | None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    def visit(node, lazy: bool) -> None:
        for child in ast.iter_child_nodes(node):
            names = []
            if isinstance(child, ast.Import):
                names = [alias.name for alias in child.names]
            elif isinstance(child, ast.ImportFrom) and child.module:
                names = [target(f"{child.module}.{alias.name}") or child.module for alias in child.names]
            edges.extend((t, lazy) for t in map(target, names) if t)
            visit(child, lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(ast.parse(open(os.path.join(REPO, path)).read(), path), False)
    return edges


def import_graph(include_lazy: bool = True) -> dict:
    modules = library_modules()
    graph = defaultdict(set)
    for name, path in modules.items():
        for imported, lazy in import_edges(path, set(modules)):
            if imported != name and (include_lazy or not lazy):
                graph[name].add(imported)
    return {name: graph[name] for name in modules}


def cycles(graph: dict) -> list[frozenset]:
    """The strongly connected components with more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(frozenset(component))
    return found


def test_no_import_cycle_even_through_imports_inside_functions():
    found = [sorted(c) for c in cycles(import_graph())]
    assert not found, f"import cycles (break them: a module both sides need is the usual way out): {found}"


def test_no_cycle_through_module_level_imports_alone():
    assert cycles(import_graph(include_lazy=False)) == []


def test_the_checker_sees_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert cycles(graph) == [frozenset({"a", "b", "c"})]


def test_the_checker_sees_a_lazy_import(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("from asyncrl.x import y\n\ndef f():\n    import asyncrl.z.w\n")
    known = {"asyncrl.x", "asyncrl.x.y", "asyncrl.z"}
    assert import_edges(str(source), known) == [("asyncrl.x.y", False), ("asyncrl.z", True)]


if __name__ == "__main__":
    modules = library_modules()
    lazy_imports = sum(lazy for path in modules.values() for _, lazy in import_edges(path, set(modules)))
    print(f"{len(modules)} modules, {lazy_imports} internal imports inside functions")
    for label, graph in (("module-level imports only", import_graph(False)), ("lazy imports included", import_graph())):
        found = cycles(graph)
        print(f"cycles, {label}: {len(found)}")
        for component in found:
            print("   ", ", ".join(sorted(component)))
    sys.exit(0)
