"""The package layout is the architecture (docs/ARCHITECTURE.md): each stage imports only what its docstring allows.

Every import is checked, also the ones inside functions, by reading the source (no module is imported).
"""
from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

# stage -> the hf_accel modules (prefixes) it may import besides its own
# errors, _compat (the transformers version gate and the names that differ across versions), family (the Family
# type) and foreign (kernel libraries' code and its stock stand-ins) are leaves every stage may import
LEAVES = ("hf_accel.errors", "hf_accel._compat", "hf_accel.family", "hf_accel.foreign", "hf_accel.binding")
ALLOWED = {
    "hf_accel.data": LEAVES,
    "hf_accel.attention": LEAVES,
    # the offline memory estimate starts from a config, so it asks the family registry for its formula
    "hf_accel.memory": (*LEAVES, "hf_accel.attention.kernels", "hf_accel.patches"),
    # family facts are handed in by patch(); the fused loss's chunk is sized where the memory estimate counts it
    "hf_accel.fused": (*LEAVES, "hf_accel.memory.targets", "hf_accel.memory.chunks"),
    "hf_accel.patches": (*LEAVES, "hf_accel.attention", "hf_accel.facts"),
    # a family's facts are read off a probe forward through the seam's own call reading, with op-level checkpointing's
    # list of the ops whose outputs it keeps
    "hf_accel.facts": (*LEAVES, "hf_accel.attention", "hf_accel.memory.targets"),
    "hf_accel.family": (),
    "hf_accel._compat": ("hf_accel.errors",),
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


def _imports(path: pathlib.Path, root: pathlib.Path = ROOT, prefix: str = "hf_accel") -> set[str]:
    """Absolute names of everything from ``prefix`` this file imports (``from .a import b`` gives ``pkg.a.b``)."""
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
    return {t for t in found if t.startswith(prefix)}


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


# ---- the benchmark harness (scripts/benchlib) depends on the library, never the reverse --------------------------
HARNESS = ROOT / "scripts" / "benchlib"


def test_nothing_in_the_library_imports_the_harness():
    """The installed package runs without scripts/: no module of hf_accel/ or patches/ imports the harness (the FLOP
    model and the model shapes the library needs live in it: training/flops.py, cli/shapes.py)."""
    bad = [f"{p.relative_to(ROOT)} imports {t}" for p in _sources()
           for t in _imports(p, prefix="benchlib") | _imports(p, prefix="hf_accel.bench")]
    assert not bad, "hf_accel/ must not import the benchmark harness (scripts/benchlib):\n" + "\n".join(bad)
    assert not list((ROOT / "hf_accel" / "bench").glob("*.py")), "the harness lives in scripts/benchlib/"


def test_the_installed_packages_are_the_library_only():
    """setup.cfg ships every package of hf_accel/ (and patches/), and nothing else: not the harness."""
    import configparser

    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    shipped = set(cfg["options"]["packages"].split())
    on_disk = {_module_name(p) for p in (ROOT / "hf_accel").rglob("__init__.py")}
    assert shipped == on_disk | {"hf_accel.patches"}


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle of ``graph`` (module -> modules it imports) as a path [a, b, ..., a], or [] if none."""
    state: dict[str, str] = {}

    def visit(node: str, path: list[str]) -> list[str]:
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return [*path[path.index(nxt):], nxt]
            if nxt not in state and (found := visit(nxt, [*path, nxt])):
                return found
        state[node] = "done"
        return []

    for start in sorted(graph):
        if start not in state and (found := visit(start, [start])):
            return found
    return []


def test_the_harness_has_no_import_cycle():
    """Every import between the harness's modules counts (inside functions and under TYPE_CHECKING too): the
    configurations import their helpers (apart, train, distributed, ...), never the other way round."""
    scripts = ROOT / "scripts"
    modules = {_module_name(p, scripts) for p in HARNESS.glob("*.py")}

    def module_of(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {_module_name(p, scripts): {m for t in _imports(p, scripts, prefix="benchlib")
                                        if (m := module_of(t)) and m != _module_name(p, scripts) and m != "benchlib"}
             for p in HARNESS.glob("*.py")}
    assert len(modules) > 5 and graph["benchlib.configs"], "the reader must see the harness's imports"
    assert not _cycle(graph), f"import cycle in scripts/benchlib: {' -> '.join(_cycle(graph))}"


def test_cycle_reader_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []


# ---- families: everything model-specific lives in patches/ ---------------------------------------------------------
def _outside_patches():
    return sorted([*(ROOT / "hf_accel").rglob("*.py"), *(ROOT / "scripts").glob("*.py")])


def _model_type_branches(path: pathlib.Path, model_types: set[str]) -> list[str]:
    """Comparisons that read a model_type (``x.model_type == ...``, ``model_type in ...``) or test a value against a
    model_type string (``family == "falcon"``), and imports of transformers' per-model modules."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            reads = any(isinstance(o, ast.Attribute) and o.attr == "model_type"
                        or isinstance(o, ast.Name) and o.id == "model_type" for o in operands)
            names = [o.value for o in operands if isinstance(o, ast.Constant) and isinstance(o.value, str)]
            names += [e.value for o in operands if isinstance(o, (ast.Tuple, ast.List, ast.Set))
                      for e in o.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
            if reads or set(names) & model_types:
                found.append(f"line {node.lineno}: compares a model_type")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("transformers.models."):
            found.append(f"line {node.lineno}: imports {node.module}")
    return found


def test_nothing_outside_patches_branches_on_model_type():
    """The estimate, fused ops, MLP chunking, the Trainers and the bench ask the family object (hf_accel.patches);
    a model_type comparison or a per-model transformers import elsewhere is a family fact in the wrong place."""
    from tiny_models import VARIANTS, make

    types = {make(name).config.model_type for name in VARIANTS}  # every family the tests verify
    bad = [f"{p.relative_to(ROOT)} {hit}" for p in _outside_patches() for hit in _model_type_branches(p, types)]
    assert not bad, "model-specific code belongs to the family's module in patches/:\n" + "\n".join(bad)


def test_branch_reader_sees_model_type_comparisons(tmp_path):
    """The checker itself: each form it must catch, and plain data it must leave alone."""
    src = tmp_path / "x.py"
    src.write_text("if config.model_type == 'llama': pass\nif fam in ('falcon', 'x'): pass\n"
                   "from transformers.models.llama.modeling_llama import LlamaMLP\nfamily = 'llama'\n")
    assert len(_model_type_branches(src, {"llama", "falcon"})) == 3


def test_every_typed_family_is_registered():
    """A family typed by hand (a model needing more than the generic seam) is its module's FAMILY, listed in the
    registry; the other modules of patches/ (what a model needs beyond the seam) type none."""
    import importlib

    from hf_accel.patches import FAMILIES, Family

    modules = sorted(p.stem for p in (ROOT / "patches").glob("*.py") if not p.stem.startswith("_"))
    families = [f for m in modules if (f := getattr(importlib.import_module(f"hf_accel.patches.{m}"), "FAMILY", None))]
    assert families and all(isinstance(f, Family) for f in families)
    assert {id(f) for f in families} == {id(f) for f in FAMILIES}
    assert len({t for f in FAMILIES for t in f.model_types}) == sum(len(f.model_types) for f in FAMILIES)


# ---- memory/: checkpoint policies receive their run as an argument ------------------------------------------------
def _module_of(target: str, modules: set[str]) -> str | None:
    """The module an imported name lives in (``pkg.mod.name`` -> ``pkg.mod``), among ``modules``."""
    while target and target not in modules:
        target = target.rpartition(".")[0]
    return target or None


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import cycle of ``graph`` (module -> modules it imports), each once, as a path that returns to its start."""
    found, done = [], set()

    def visit(node, path):
        if node in path:
            cycle = path[path.index(node):]
            if not any(set(cycle) == set(c) for c in found):
                found.append([*cycle, node])
            return
        if node in done:
            return
        for nxt in sorted(graph.get(node, ())):
            visit(nxt, [*path, node])
        done.add(node)

    for start in sorted(graph):
        visit(start, [])
    return found


def _import_graph(prefix: str) -> dict[str, set[str]]:
    paths = [p for p in _sources() if _within(_module_name(p), prefix)]
    modules = {_module_name(p) for p in paths}
    graph = {}
    for path in paths:
        name = _module_name(path)
        graph[name] = {m for t in _imports(path) if (m := _module_of(t, modules)) not in (None, name, prefix)}
    return graph


def test_memory_has_no_import_cycle():
    """memory/ imports downward only (the policies' face ``checkpointing`` -> ``budget`` -> ``policies``, ``plan``,
    ``state``), lazy imports included: a cycle is what made checkpointing.py re-export MemoryBudget lazily."""
    cycles = _cycles(_import_graph("hf_accel.memory"))
    assert not cycles, "import cycles in hf_accel/memory:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_cycle_reader_sees_a_cycle():
    """The checker itself: a lazy import back into a module that imports it is a cycle; a diamond is not."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    assert _cycles({"a": {"b", "c"}, "b": {"d"}, "c": {"d"}, "d": set()}) == []


def _isinstance_of(path: pathlib.Path, name: str) -> list[int]:
    """Lines of ``path`` that call isinstance(..., name) (also inside a tuple of classes)."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance" \
                and len(node.args) == 2:
            classes = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
            if any(isinstance(c, ast.Name) and c.id == name or isinstance(c, ast.Attribute) and c.attr == name
                   for c in classes):
                lines.append(node.lineno)
    return lines


def test_nothing_outside_memory_asks_whether_a_policy_is_a_budget():
    """Callers hand every policy its run (``policy.apply(model, context)``, memory.context); what a budget does with
    it is the budget's business, so no code outside memory/ tests for MemoryBudget."""
    bad = [f"{p.relative_to(ROOT)} line {line}" for p in [*_sources(), *(ROOT / "scripts").rglob("*.py")]
           if not _within(_module_name(p), "hf_accel.memory") for line in _isinstance_of(p, "MemoryBudget")]
    assert not bad, "isinstance(..., MemoryBudget) outside hf_accel/memory:\n" + "\n".join(bad)


def test_isinstance_reader_sees_budget_checks(tmp_path):
    src = tmp_path / "x.py"
    src.write_text("isinstance(p, MemoryBudget)\nisinstance(p, (int, budget.MemoryBudget))\nisinstance(p, int)\n")
    assert _isinstance_of(src, "MemoryBudget") == [1, 2]


# ---- patch(): a short pipeline ------------------------------------------------------------------------------------
MAX_FUNCTION_LINES = 60  # STYLE.md: a function past ~60 lines is asking to be split


def _long_functions(path: pathlib.Path, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """Functions of ``path`` whose code (the docstring not counted) runs over ``limit`` lines."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            start = node.body[1].lineno if ast.get_docstring(node) and len(node.body) > 1 else node.lineno
            lines = node.end_lineno - start + 1
            if lines > limit:
                found.append(f"{node.name} ({lines} lines)")
    return found


@pytest.mark.parametrize("module", ["patching.py", "patch_options.py", "kernel_choice.py"])
def test_patch_pipeline_functions_are_short(module):
    """patch() reads as a pipeline (options, decisions, kernel choice, binding, report), each step a short function."""
    long = _long_functions(ROOT / "hf_accel" / module)
    assert not long, f"hf_accel/{module}: functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_function_length_reader_skips_docstrings(tmp_path):
    src = tmp_path / "x.py"
    body = "\n".join(f"    x{i} = {i}" for i in range(61))
    src.write_text(f'def long():\n{body}\n\ndef documented():\n    """{"doc" + chr(10) * 80}"""\n    return 1\n')
    assert _long_functions(src) == ["long (62 lines)"]


# ---- the Trainer: classes and loop hooks in trainer.py, each concern in its own module -----------------------------
TRAINER_CONCERNS = ("sequence_parallel", "compile_rules", "data_loading", "run_context")


@pytest.mark.parametrize("module", ["trainer", *TRAINER_CONCERNS])
def test_trainer_concerns_are_small_modules_that_do_not_reach_back(module):
    """AccelMixin names its concerns; the modules that hold them (DeepSpeed / sequence-parallel wiring, compile rules,
    data loading, the run a policy is applied for) stay small and never import the Trainer module back."""
    path = ROOT / "hf_accel" / "training" / f"{module}.py"
    assert len(path.read_text().splitlines()) <= 400
    assert not _long_functions(path), _long_functions(path)
    if module != "trainer":
        assert not any(_within(t, "hf_accel.training.trainer") for t in _imports(path))
