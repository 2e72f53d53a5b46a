"""The package layout is the architecture (docs/ARCHITECTURE.md): each stage imports only what its docstring allows.

Every import is checked, also the ones inside functions, by reading the source (no module is imported).
"""
from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

# stage -> the hf_accel modules (prefixes) it may import besides its own
ALLOWED = {
    "hf_accel.data": ("hf_accel.errors",),
    "hf_accel.attention": ("hf_accel.errors",),
    "hf_accel.memory": ("hf_accel.errors", "hf_accel.attention.kernels"),
    "hf_accel.fused": ("hf_accel.errors", "hf_accel.memory.targets"),
    "hf_accel.patches": ("hf_accel.errors", "hf_accel.attention"),
}
FACE_ONLY = "hf_accel.training"  # imported by nothing but the package face, itself and scripts


def _module_name(path: pathlib.Path, root: pathlib.Path = ROOT) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = list(rel.parts)
    if parts[0] == "patches":
        parts = ["hf_accel", *parts]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: pathlib.Path, root: pathlib.Path = ROOT) -> set[str]:
    """Absolute names of everything from hf_accel this file imports (``from .a import b`` gives ``pkg.a.b``)."""
    name = _module_name(path, root)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            found |= {f"{target}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return {t for t in found if t.startswith("hf_accel")}


def _sources():
    return sorted([*(ROOT / "hf_accel").rglob("*.py"), *(ROOT / "patches").glob("*.py")])


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


@pytest.mark.parametrize("stage", sorted(ALLOWED))
def test_stage_imports_only_what_it_may(stage):
    bad = []
    for path in _sources():
        module = _module_name(path)
        if not _within(module, stage):
            continue
        for target in _imports(path):
            if not (_within(target, stage) or any(_within(target, ok) for ok in ALLOWED[stage])):
                bad.append(f"{path.relative_to(ROOT)} imports {target}")
    assert not bad, f"{stage} may import only {ALLOWED[stage]} (docs/ARCHITECTURE.md):\n" + "\n".join(bad)


FACES = ("hf_accel", "hf_accel.cli")  # the package's face and the installed command


def test_training_is_imported_only_by_the_faces():
    bad = [f"{p.relative_to(ROOT)} imports {t}" for p in _sources()
           if not any(_within(_module_name(p), face) if face != "hf_accel" else _module_name(p) == face
                      for face in FACES) and not _within(_module_name(p), FACE_ONLY)
           for t in _imports(p) if _within(t, FACE_ONLY)]
    assert not bad, "only hf_accel/__init__.py and hf_accel/cli/ may import hf_accel.training:\n" + "\n".join(bad)


def test_import_reader_sees_relative_and_lazy_imports(tmp_path):
    """The checker itself: relative imports inside a function are found and resolved."""
    pkg = tmp_path / "hf_accel" / "memory"
    pkg.mkdir(parents=True)
    src = pkg / "x.py"
    src.write_text("def f():\n    from ..training import trainer\n    from . import plan\n    import torch\n")
    assert _imports(src, tmp_path) == {"hf_accel.training.trainer", "hf_accel.memory.plan"}


@pytest.mark.parametrize("package", ["data", "attention", "memory", "fused", "training"])
def test_each_stage_says_what_it_owns_and_may_import(package):
    doc = ast.get_docstring(ast.parse((ROOT / "hf_accel" / package / "__init__.py").read_text())) or ""
    assert "May import" in doc, f"hf_accel/{package}/__init__.py must open with what it owns and may import"
