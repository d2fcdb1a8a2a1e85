"""raykv's modules import each other in one direction: no import cycles, none hidden under
``TYPE_CHECKING`` or inside functions, and no module reads another module's ``_private`` names.

The layer rules between packages are import-linter contracts (pyproject.toml, run by ``.ci/run``);
this test covers what those contracts do not: cycles between any two modules, and private names.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "raykv"


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Every raykv module ``module`` imports, at any level of the file (TYPE_CHECKING included)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules]
            names = subs if len(subs) == len(node.names) else [*subs, base]
        else:
            continue
        found.update(r for r in (_resolve(n, modules) for n in names) if r and r != module)
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
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
    return found


def test_no_import_cycles_between_raykv_modules():
    """The root package (the public facade) is a module like the others: a module the facade
    imports may not import it back; a module above it (an engine integration) may."""
    modules = _modules()
    graph = {m: _imports(m, p, modules) for m, p in modules.items()}
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_cycles():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_another_modules_private_names():
    modules = _modules()
    offenders = []
    for module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and _resolve(node.module, modules):
                offenders += [
                    f"{module} imports {node.module}.{a.name}" for a in node.names if _private(a.name)
                ]
    assert offenders == []


# Private reads that are not another raykv module's internals: an object of the same class
# (``__eq__``), a namedtuple's public-by-convention ``_fields``, and two third-party objects.
ALLOWED_PRIVATE_READS = {
    ("raykv.transfer.net.auth", "other._secret"),  # Token.__eq__ compares two tokens
    ("raykv.transfer.paths.serving", "LeasedBlock._fields"),  # namedtuple API
    ("raykv.transfer.net.runtime", "ucxx.core._get_ctx"),  # ucxx has no public way to ask
    ("raykv.core.threads", "copy_threads()._max_workers"),  # ThreadPoolExecutor's size
    ("raykv.bench.gpu", "torch.cuda._sleep"),  # torch's only GPU-side sleep (GPU-time rows)
    ("raykv.core.tiers.cuda_calls", "torch._C"),  # the raw current stream (getattr, with a fallback)
}


def test_no_object_reads_another_objects_private_attributes():
    """``obj._name`` anywhere in raykv/ where ``obj`` is not ``self``/``cls``/``super()`` and
    ``_name`` is not defined in the same module: an object's private state is read only by code
    of its own module."""
    offenders = []
    for module, path in _modules().items():
        tree = ast.parse(path.read_text())
        own = _own_private_names(tree)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and _private(node.attr)) or node.attr in own:
                continue
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                continue
            if isinstance(owner, ast.Call) and ast.unparse(owner.func) == "super":
                continue
            read = ast.unparse(node)
            if (module, read) not in ALLOWED_PRIVATE_READS:
                offenders.append(f"{module}:{node.lineno} {read}")
    assert offenders == []


def _own_private_names(tree: ast.Module) -> set[str]:
    """Private names a module defines itself (``self._x = ...``, ``def _x``, ``__slots__``): a
    helper class in the same module (a lock, a view) may read them."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            if isinstance(node.value, ast.Name) and node.value.id == "self":
                names.add(node.attr)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return {n for n in names if _private(n)}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")
