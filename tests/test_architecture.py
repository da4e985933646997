"""The package's structure, as docs/architecture.md states it: modules a reader can hold, no
module reaching into another's private names, an import graph without cycles, and functions
of at most 80 lines."""
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


# A backend's primitives are designed to be called from outside the backend: by the store
# base, the pipeline and the composite store (docs/architecture.md, "Stores"). They keep a
# leading underscore because users never call them. These, and only these, may be used on
# another object than ``self`` outside the module defining them.
DESIGNED_PRIMITIVES = {
    # the pipeline moves a unit's bytes through the store's primitives, a slice each
    # (_submit_read/_submit_write; _view on resident stores); extents of several slices go
    # through the public store.extents (NVMeStore's packed small states)
    "statestore/pipeline.py": {"_submit_read", "_submit_write", "_view"},
}


def _private(name):
    return name.startswith("_") and not name.startswith("__")


def _defined_here(tree):
    """Private names a module defines: its module-level and class-level definitions and
    assignments, attributes it assigns on ``self``/``cls``, and ``__slots__`` entries."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            out.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            out.add(node.attr)
        elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__slots__"
                                                  for t in node.targets):
            out.update(c.value for c in ast.walk(node.value) if isinstance(c, ast.Constant))
    return {n for n in out if isinstance(n, str) and _private(n)}


def _attribute_uses(tree):
    """``(line, object, name, sets)`` for every ``x._name`` (and ``getattr``/``setattr``/
    ``hasattr``/``delattr`` of a constant private name) on an object other than self/cls."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            yield (node.lineno, ast.unparse(node.value), node.attr,
                   isinstance(node.ctx, (ast.Store, ast.Del)))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id in ("getattr", "setattr", "hasattr", "delattr") \
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) \
                and isinstance(node.args[1].value, str) and _private(node.args[1].value):
            obj = node.args[0]
            if isinstance(obj, ast.Name) and obj.id in ("self", "cls"):
                continue
            yield (node.lineno, ast.unparse(obj), node.args[1].value,
                   node.func.id in ("setattr", "delattr"))


def test_no_private_attributes_used_across_objects():
    """An object is used through its public names: ``x._name`` on another object than
    self/cls, outside the module that defines ``_name``, reaches into it. Reading another
    library's private API (``torch._C``, ``tensor._version``) is outside this rule; setting a
    private attribute on any object the module does not define is inside it (keep a side
    table). The only exceptions are DESIGNED_PRIMITIVES."""
    trees = {mod: ast.parse(path.read_text(), str(path)) for mod, path in MODULES.items()}
    defined = {mod: _defined_here(t) for mod, t in trees.items()}
    ours = set().union(*defined.values())
    bad = []
    for mod, tree in trees.items():
        rel = str(MODULES[mod].relative_to(ROOT.parent))
        allowed = defined[mod] | DESIGNED_PRIMITIVES.get(rel, set())
        for line, obj, name, sets in _attribute_uses(tree):
            if name in allowed or not (sets or name in ours):
                continue
            bad.append(f"{rel}:{line}: {obj}.{name}" + (" (set)" if sets else ""))
    assert not bad, "private attributes used across objects:\n" + "\n".join(sorted(bad))


def _module_level(body):
    """The statements run at module level: ``body`` and the bodies of its ``if``/``try``/
    ``with`` blocks, not those of functions or classes."""
    for node in body:
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            for field in ("body", "orelse", "finalbody", "handlers"):
                yield from _module_level(getattr(node, field, None) or [])


def test_all_names_what_the_module_defines():
    """Every name in a module's ``__all__`` is defined or imported by it (a name left there
    after its definition moved breaks ``from module import *``). Modules that load names on
    first use (a module ``__getattr__``) or star-import are not checked."""
    bad = []
    for mod, path in MODULES.items():
        tree = ast.parse(path.read_text(), str(path))
        names, exported = set(), None
        for node in _module_level(tree.body):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names.update((a.asname or a.name).split(".")[0] for a in node.names)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                for t in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                    names.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
                    if isinstance(t, ast.Name) and t.id == "__all__" \
                            and isinstance(node, ast.Assign):
                        try:
                            exported = list(ast.literal_eval(node.value))
                        except ValueError:
                            exported = None     # computed: not checked
        if "__getattr__" in names or "*" in names:
            continue
        bad += [f"{path.relative_to(ROOT.parent)}: {n}" for n in exported or () if n not in names]
    assert not bad, "__all__ names not defined:\n" + "\n".join(bad)


def _own_names(cls):
    """The names a class body defines: its methods and class attributes, ``__slots__``, and
    the attributes its methods assign on ``self``/``cls``."""
    out = set()
    for st in cls.body:
        if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out.add(st.name)
        elif isinstance(st, (ast.Assign, ast.AnnAssign)):
            for t in (st.targets if isinstance(st, ast.Assign) else [st.target]):
                out.update(x.id for x in ast.walk(t) if isinstance(x, ast.Name))
            if isinstance(st, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__slots__"
                                                  for t in st.targets):
                out.update(c.value for c in ast.walk(st.value) if isinstance(c, ast.Constant))
    for n in ast.walk(cls):
        if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) \
                and isinstance(n.value, ast.Name) and n.value.id in ("self", "cls"):
            out.add(n.attr)
    return out


def test_no_class_is_a_mixin_of_its_subclasses():
    """A class of the package that others derive from uses only the private attributes it
    or its own bases define: a base reading ``self._x`` that only a subclass sets is a mixin,
    a class cut across files that shares its host's attributes (docs/architecture.md, "Seams
    between objects": the parts are objects the class holds instead)."""
    classes = {}
    for path in MODULES.values():
        for n in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(n, ast.ClassDef):
                classes[n.name] = (path, n)

    def bases(cls):
        return [ast.unparse(b).split(".")[-1].split("[")[0] for b in cls.bases]

    def lineage(name, seen):
        if name not in classes or name in seen:
            return set()
        seen.add(name)
        cls = classes[name][1]
        return _own_names(cls).union(*(lineage(b, seen) for b in bases(cls)))

    bad = []
    for name in sorted({b for _, c in classes.values() for b in bases(c) if b in classes}):
        path, cls = classes[name]
        known = lineage(name, set())
        reads = sorted({n.attr for n in ast.walk(cls) if isinstance(n, ast.Attribute)
                        and isinstance(n.value, ast.Name) and n.value.id == "self"
                        and _private(n.attr)} - known)
        if reads:
            bad.append(f"{path.relative_to(ROOT.parent)}: {name} reads {', '.join(reads)}")
    assert not bad, "base classes using their subclasses' attributes (mixins):\n" + "\n".join(bad)


MAX_FUNCTION_LINES = 80


def test_no_function_is_long():
    """Every function and method, its docstring included, fits in MAX_FUNCTION_LINES lines:
    a longer one is split into functions that each do one thing."""
    bad = []
    for path in MODULES.values():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    bad.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}: {node.name} "
                               f"has {n} lines")
    assert not bad, (f"functions over {MAX_FUNCTION_LINES} lines (split them):\n"
                     + "\n".join(bad))


def _documented_store_names():
    """The names docs/api.md's table "A store's public names" lists (its first column:
    ``name`` or ``Class.name``, arguments dropped)."""
    import re
    text = (ROOT.parent / "docs" / "api.md").read_text()
    section = text.split("### A store's public names", 1)[1].split("\n#", 1)[0]
    names = set()
    for line in section.splitlines():
        if line.startswith("| `"):
            cell = line.split("|")[1]
            names.update(re.findall(r"`([A-Za-z_][\w.]*)", cell))
    return names


def _public_names(cls):
    """A class's public names: ``dir(cls)`` (methods, properties, class attributes) and the
    public attributes the methods of it and its statestore bases assign on ``self``."""
    import inspect
    import textwrap
    names = {n for n in dir(cls) if not _private(n) and not n.startswith("__")}
    for k in cls.__mro__:
        if k.__module__.startswith("statestore"):
            tree = ast.parse(textwrap.dedent(inspect.getsource(k)))
            names |= {n for n in _own_names(tree.body[0])
                      if not _private(n) and not n.startswith("__")}
    return names


def test_store_public_surface_is_documented():
    """Every public name of StateStore, and of each store class beyond it, is in docs/api.md's
    table of a store's public names, and every name there exists: internal plumbing cannot
    become public (or a documented name vanish) without the table changing too."""
    import statestore.backends as backends
    from statestore.store import StateStore
    base = _public_names(StateStore)
    found = set(base)
    for name in backends.__all__:
        cls = getattr(backends, name)
        if isinstance(cls, type) and issubclass(cls, StateStore):
            found |= {f"{cls.__name__}.{n}" for n in _public_names(cls) - base}
    documented = _documented_store_names()
    assert found == documented, (
        f"public but not in docs/api.md's table: {sorted(found - documented)}; in the table "
        f"but not public: {sorted(documented - found)}")
