"""The package's structure, as docs/architecture.md states it: modules a reader can hold, no
module reaching into another's private names, and an import graph without cycles."""
import ast
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "statestore"
MAX_LINES = 600


def _modules():
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        yield ".".join(parts), path


MODULES = dict(_modules())


def _is_extension(mod):
    parts = mod.split(".")
    folder = ROOT.parent.joinpath(*parts[:-1])
    return any(folder.glob(parts[-1] + ".*.so"))


def _resolve(name, level, here, is_pkg):
    if level == 0:
        return name
    base = here.split(".") if is_pkg else here.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def _imports(mod, path):
    """(target module, imported names) for every statestore import of ``mod``, lazy ones too."""
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            target = _resolve(node.module or "", node.level, mod, is_pkg)
            if target.split(".")[0] != "statestore":
                continue
            names = [a.name for a in node.names]
            out.append((target, names, node.lineno))
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "statestore":
                    out.append((a.name, [], node.lineno))
    return out


@pytest.mark.parametrize("mod", sorted(MODULES))
def test_module_is_short(mod):
    n = len(MODULES[mod].read_text().splitlines())
    assert n <= MAX_LINES, f"{MODULES[mod]} has {n} lines (at most {MAX_LINES})"


def test_no_module_imports_another_modules_private_names():
    bad = []
    for mod, path in MODULES.items():
        for target, names, line in _imports(mod, path):
            for name in names:
                # a private submodule of the importer's own package (or a compiled extension
                # of it) is the package's own; a private name of another module is not
                sub = f"{target}.{name}"
                own = mod.startswith(target + ".") and (sub in MODULES or _is_extension(sub))
                if name.startswith("_") and not name.startswith("__") and not own:
                    bad.append(f"{path.relative_to(ROOT.parent)}:{line}: {name} from {target}")
    assert not bad, "private names imported across modules:\n" + "\n".join(bad)


def test_import_graph_has_no_cycles():
    graph = {}
    for mod, path in MODULES.items():
        deps = set()
        for target, names, _ in _imports(mod, path):
            # `from pkg import sub` imports the submodule pkg.sub
            subs = [f"{target}.{n}" for n in names
                    if f"{target}.{n}" in MODULES or _is_extension(f"{target}.{n}")]
            deps.update(subs or ([target] if target in MODULES else []))
        deps.discard(mod)
        graph[mod] = {d for d in deps if d in MODULES}
    seen, stack, cycles = {}, [], []

    def visit(m):
        seen[m] = 1
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if seen.get(d) == 1:
                cycles.append(stack[stack.index(d):] + [d])
            elif d not in seen:
                visit(d)
        stack.pop()
        seen[m] = 2

    for m in sorted(graph):
        if m not in seen:
            visit(m)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)
