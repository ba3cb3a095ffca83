"""The Python layer's structure: the import graph of python/amber has no cycle (an
import inside a function counts: it hides a cycle, it does not remove one), no module
imports another module's private names, and no module of amber.torch grows past about
600 lines (flat declaration lists aside)."""
import ast
import os

from conftest import ROOT

PKG = os.path.join(ROOT, "python", "amber")


def modules():
    """{module name: path} of every module of the package."""
    out = {}
    for d, _, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(d, f), os.path.dirname(PKG))[:-3]
                name = rel.replace(os.sep, ".")
                out[name[:-len(".__init__")] if name.endswith(".__init__") else name] = \
                    os.path.join(d, f)
    return out


def imports(name, path, known):
    """The amber modules that module `name` imports anywhere in its text, and the
    private names it takes from them: [(module, [names])]."""
    tree = ast.parse(open(path).read())
    pkg = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names if a.name in known]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = pkg.split(".")
                up = parts[:len(parts) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                if sub in known:  # "from amber import device": the module itself
                    out.append((sub, []))
                elif base in known:
                    out.append((base, [a.name]))
    return out


def test_no_import_cycles_in_the_python_layer():
    known = modules()
    graph = {}
    for name, path in known.items():
        graph[name] = {m for m, _ in imports(name, path, known) if m != name}
    # a cycle: a path back to the start through imports
    cycles = []
    for start in graph:
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for nxt in graph.get(node, ()):
                if nxt == start:
                    cycles.append(path + [nxt])
                elif nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, path + [nxt]))
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles[:5])


def test_no_module_takes_another_modules_private_names():
    known = modules()
    bad = []
    for name, path in known.items():
        for mod, names in imports(name, path, known):
            priv = [n for n in names if n.startswith("_") and n != "__version__"]
            if priv and mod != "amber":  # the binding's ctypes helpers are shared by design
                bad.append(f"{name} takes {priv} from {mod}")
    assert not bad, bad


def test_amber_torch_modules_stay_small():
    big = []
    for f in os.listdir(os.path.join(PKG, "torch")):
        if f.endswith(".py"):
            n = sum(1 for _ in open(os.path.join(PKG, "torch", f)))
            if n > 650:
                big.append(f"{f}: {n} lines")
    assert not big, big
