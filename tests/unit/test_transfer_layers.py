"""raykv.transfer's structure: one TransferPath class per path, and imports that form no cycle."""

from __future__ import annotations

import ast
import pathlib

import raykv.transfer
from raykv.transfer import PATH_CLASSES, TransferConfig, TransferPath
from raykv.transfer.net import wire
from raykv.transfer.paths.registry import REQUEST_PATHS

PACKAGE = pathlib.Path(raykv.transfer.__file__).parent


def _imports(path: pathlib.Path) -> set[str]:
    """Every raykv.transfer module ``path`` imports (anywhere: top level, functions, TYPE_CHECKING);
    ``from raykv.transfer import x`` counts as importing the package."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return {name for name in found if name == "raykv.transfer" or name.startswith("raykv.transfer.")}


def test_no_submodule_imports_the_package_and_no_cycle() -> None:
    graph = {
        f"raykv.transfer.{p.stem}": _imports(p) - {f"raykv.transfer.{p.stem}"}
        for p in PACKAGE.glob("*.py")
        if p.stem != "__init__"
    }
    for module, deps in graph.items():
        assert "raykv.transfer" not in deps, f"{module} imports the package"
    done: set[str] = set()

    def visit(module: str, stack: tuple[str, ...]) -> None:
        assert module not in stack, f"import cycle: {' -> '.join((*stack, module))}"
        if module in done:
            return
        for dep in graph.get(module, ()):
            visit(dep, (*stack, module))
        done.add(module)

    for module in graph:
        visit(module, ())


def test_one_class_per_path() -> None:
    names = [cls.name for cls in PATH_CLASSES]
    assert sorted(names) == sorted(["shm_read", "gpu_read", "shm", "ucx", "direct", "gpu_peer"])
    assert all(issubclass(cls, TransferPath) for cls in PATH_CLASSES)
    served = {cls.name for cls in PATH_CLASSES if not cls.one_sided}
    assert served == set(wire.PATHS)
    assert set(REQUEST_PATHS) == {"shm", "ucx"}


def test_server_path_registry_answers_every_name() -> None:
    from raykv.transfer.paths.registry import server_paths

    class NoExport:
        available = False

    made = server_paths(-1, TransferConfig.loopback(), NoExport())  # type: ignore[arg-type]
    assert set(made) == {cls.name for cls in PATH_CLASSES}
    assert all(made[name].name == name for name in made)
