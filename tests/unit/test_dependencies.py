"""The floor plan's import rules (docs/design.md, "Layout" and "Dependency direction").

- train.py -> megazero.training -> model, data, megazero; model -> megazero; the library
  packages of megazero (all but megazero.training, the application layer) import neither model
  nor data nor megazero.training; data imports neither model nor megazero; nothing imports train.
- Inside megazero/: the root modules (the foundation: topology, process_groups,
  collectives, precision, param_spec, tags) import no subpackage; config/ imports nothing from
  runtime/, planning/ or checkpoint/.
- No circle between the packages of megazero/: a package is a first-level sub-package
  (``megazero.optim``, ``megazero.offload``, every module below it included); the root
  modules count as one group, ``megazero`` (the foundation, which imports no sub-package, so it
  can close no circle). ``optim -> data_parallel -> optim`` is a circle even when no two files
  import each other.
- No ZeRO stage number compared outside ``data_parallel/policy.py`` and ``data_parallel/stages.py``:
  the rest asks the stage's policy (``shards_grads``, ``staging_slots``, ...).
- No import circle between the files of megazero/, model/ and data/ (every import counts,
  also one inside a function), no module-level ``__getattr__`` and no private name
  (``_x``) imported from another file anywhere (library, train.py, scripts/, tests/).
- Tests and scripts share helpers only through ``tests.support``: a test module imports no
  other test module, and scripts import nothing of tests/ but ``tests.support``.
- A test takes nothing from a user tool (``scripts/*.py``) but its ``main(argv)``; what tests
  need of a tool lives in the library. Benchmarks (``scripts/bench/``) are tested through their
  public measuring functions.
"""

import ast
from pathlib import Path

import pytest

from tests.support.paths import REPO

ROOT = REPO
FORBIDDEN = {"megazero": {"model", "data", "train"}, "model": {"data", "train"}, "data": {"model", "megazero", "train"}}
LIBRARY = ("megazero", "model", "data")
FOUNDATION = {
    "megazero.topology",
    "megazero.process_groups",
    "megazero.collectives",
    "megazero.precision",
    "megazero.param_spec",
    "megazero.tags",
}


def _tree(path: Path) -> ast.Module:
    """The file's syntax tree without its ``if TYPE_CHECKING:`` blocks (annotations only)."""
    tree = ast.parse(path.read_text(), str(path))
    tree.body = [
        n
        for n in tree.body
        if not (isinstance(n, ast.If) and isinstance(n.test, ast.Name) and n.test.id == "TYPE_CHECKING")
    ]
    return tree


def _imported_packages(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    """Every module of the library packages, by dotted name (a package by its __init__)."""
    return {_module_name(f): f for pkg in LIBRARY for f in sorted((ROOT / pkg).rglob("*.py"))}


def _imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The library modules ``path`` imports: ``from a.b import c`` is module a.b.c when that
    is a module, else a.b; ``import a.b`` is a.b. A package's implicit parent imports are
    not counted (Python runs them, but they are not edges a file chose)."""
    out = set()
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in known}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in known:
            subs = {f"{node.module}.{a.name}" for a in node.names} & known.keys()
            out |= subs
            if len(subs) < len(node.names):
                out.add(node.module)
    return out - {_module_name(path)}


def _graph() -> dict[str, set[str]]:
    known = _modules()
    return {name: _imports(path, known) for name, path in known.items()}


APPLICATION = ROOT / "megazero" / "training"  # the trainer: may import model and data


def _forbidden(path: Path) -> set[str]:
    """The top-level packages ``path`` must not import."""
    if path.is_relative_to(APPLICATION):
        return {"train"}
    return FORBIDDEN[path.relative_to(ROOT).parts[0]]


def _imports_training(path: Path) -> bool:
    """Whether ``path`` imports megazero.training (or a module of it)."""
    for node in ast.walk(_tree(path)):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        if any(n == "megazero.training" or n.startswith("megazero.training.") for n in names):
            return True
    return False


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_follow_the_dependency_direction(package):
    files = sorted((ROOT / package).rglob("*.py"))
    assert files
    bad = {str(f.relative_to(ROOT)): sorted(_imported_packages(f) & _forbidden(f)) for f in files}
    assert {f: b for f, b in bad.items() if b} == {}
    upward = [str(f.relative_to(ROOT)) for f in files if not f.is_relative_to(APPLICATION) and _imports_training(f)]
    assert upward == []  # the trainer sits above the library, model and data


def test_the_dependency_rules_see_a_planted_import(tmp_path, monkeypatch):
    """A library module importing model, or the trainer, is caught (the rules are not vacuous)."""
    planted = tmp_path / "megazero" / "moe" / "planted.py"
    planted.parent.mkdir(parents=True)
    planted.write_text("from model.gpt import GPT\nfrom megazero.training import build_trainer\n")
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    monkeypatch.setattr(f"{__name__}.APPLICATION", tmp_path / "megazero" / "training")
    assert _imported_packages(planted) & _forbidden(planted) == {"model"}
    assert _imports_training(planted)


def test_nothing_imports_train_py():
    """train.py is the entry only: tests, scripts and benchmarks use megazero.training."""
    files = [f for f in ROOT.rglob("*.py") if ".venv" not in f.parts and f.name != "train.py"]
    bad = [str(f.relative_to(ROOT)) for f in files if "train" in _imported_packages(f)]
    assert bad == []
    assert len((ROOT / "train.py").read_text().splitlines()) <= 150


def test_the_megazero_root_holds_only_the_foundation_and_it_imports_no_subpackage():
    graph = _graph()
    root = {
        m
        for m in graph
        if m.startswith("megazero.") and m.count(".") == 1 and (ROOT / m.replace(".", "/")).with_suffix(".py").exists()
    }
    assert root == FOUNDATION
    assert {
        m: sorted(d for d in graph[m] if d not in FOUNDATION)
        for m in sorted(root)
        if any(d not in FOUNDATION for d in graph[m])
    } == {}


def test_config_imports_nothing_from_runtime_planning_or_checkpoint():
    above = ("megazero.runtime", "megazero.planning", "megazero.checkpoint")
    graph = _graph()
    bad = {
        m: sorted(d for d in deps if d.startswith(above))
        for m, deps in graph.items()
        if m.startswith("megazero.config")
    }
    assert {m: d for m, d in bad.items() if d} == {}
    assert any(m.startswith("megazero.config.") for m in graph)  # the package exists


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_cycle_finder_sees_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_between_library_files():
    assert _cycles(_graph()) == []


def _package(module: str, modules: set[str]) -> str:
    """The megazero package a module belongs to: ``megazero.optim.zero`` and ``megazero.optim``
    (its ``__init__``) -> ``megazero.optim``; a root module (the foundation) -> ``megazero``.
    ``modules``: every module, to tell a package's ``__init__`` from a root module."""
    parts = module.split(".")
    top = ".".join(parts[:2])
    if len(parts) > 2 or any(m.startswith(top + ".") for m in modules):
        return top
    return parts[0]


def _package_graph(graph: dict[str, set[str]]) -> tuple[dict[str, set[str]], dict[tuple[str, str], list[str]]]:
    """The megazero package graph of the module ``graph``, and per package edge the module
    imports that make it (``"a.b -> c.d"``, for the failure message)."""
    packages: dict[str, set[str]] = {}
    why: dict[tuple[str, str], list[str]] = {}
    modules = set(graph) | {d for deps in graph.values() for d in deps}
    for m, deps in graph.items():
        if not m.startswith("megazero"):
            continue
        src = _package(m, modules)
        packages.setdefault(src, set())
        for d in deps:
            dst = _package(d, modules)
            if d.startswith("megazero") and dst != src:
                packages[src].add(dst)
                why.setdefault((src, dst), []).append(f"{m} -> {d}")
    return packages, why


def test_the_package_graph_sees_a_circle_that_no_two_files_close():
    graph = {
        "megazero.a.x": {"megazero.b.y"},
        "megazero.b.y": set(),
        "megazero.b.z": {"megazero.a.w"},
        "megazero.a.w": {"megazero.topology"},
        "megazero.topology": set(),
    }
    assert _cycles(graph) == []
    packages, why = _package_graph(graph)
    assert packages == {"megazero.a": {"megazero", "megazero.b"}, "megazero.b": {"megazero.a"}, "megazero": set()}
    assert _cycles(packages) == [["megazero.a", "megazero.b"]]
    assert why[("megazero.b", "megazero.a")] == ["megazero.b.z -> megazero.a.w"]


def test_no_import_circle_between_megazero_packages():
    packages, why = _package_graph(_graph())
    assert {"megazero", "megazero.optim", "megazero.data_parallel", "megazero.offload"} <= packages.keys()
    circles = _cycles(packages)
    edges = {f"{a} -> {b}": why[a, b] for c in circles for a in c for b in sorted(packages[a]) if b in c}
    assert circles == [], edges


def _is_zero_stage(node: ast.AST) -> bool:
    """``zero_stage``, ``<x>.zero_stage``, ``<x>.zero.stage``, ``z.stage`` or ``<x>.strategy.stage``."""
    if isinstance(node, ast.Name):
        return node.id == "zero_stage"
    if isinstance(node, ast.Attribute) and node.attr == "zero_stage":
        return True
    if isinstance(node, ast.Attribute) and node.attr == "stage":
        v = node.value
        return (isinstance(v, ast.Name) and v.id == "z") or (
            isinstance(v, ast.Attribute) and v.attr in ("zero", "strategy")
        )
    return False


def _is_number(node: ast.AST) -> bool:
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return bool(node.elts) and all(_is_number(e) for e in node.elts)
    return isinstance(node, ast.Constant) and isinstance(node.value, int)


def _stage_comparisons(path: Path) -> list[int]:
    """Lines of ``path`` comparing a ZeRO stage with a number (``stage == 3``, ``stage in (1, 2)``)."""
    out = []
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(_is_zero_stage(a) for a in sides) and any(_is_number(a) for a in sides):
                out.append(node.lineno)
    return out


def test_the_stage_finder_sees_a_comparison(tmp_path):
    f = tmp_path / "x.py"
    f.write_text(
        "a = cfg.zero.stage == 3\nb = z.stage in (1, 2)\nc = zero_stage >= 2\n"
        "d = self.strategy.stage != 0\ne = stage == 0\nf = z.stage in POLICIES\ng = e.zero_stage < 2\n"
    )
    assert _stage_comparisons(f) == [1, 2, 3, 4, 7]


def test_no_zero_stage_number_compared_outside_the_policy():
    allowed = {"megazero/data_parallel/policy.py", "megazero/data_parallel/stages.py"}
    bad = {
        str(f.relative_to(ROOT)): _stage_comparisons(f)
        for pkg in ("megazero", "model", "data", "scripts")
        for f in sorted((ROOT / pkg).rglob("*.py"))
        if str(f.relative_to(ROOT)) not in allowed
    }
    assert {f: lines for f, lines in bad.items() if lines} == {}


def _project_files() -> list[Path]:
    """Every Python file of the project: the library packages, train.py, scripts/ and tests/."""
    files = [f for pkg in LIBRARY + ("scripts", "tests") for f in (ROOT / pkg).rglob("*.py")]
    return sorted(files + [ROOT / "train.py"])


def test_no_module_level_getattr():
    bad = [
        str(f.relative_to(ROOT))
        for f in _project_files()
        if any(isinstance(n, ast.FunctionDef) and n.name == "__getattr__" for n in _tree(f).body)
    ]
    assert bad == []


def _project_modules() -> set[str]:
    """Dotted names of every module and package of the project (library, scripts, tests)."""
    files = [f for pkg in LIBRARY + ("scripts", "tests") for f in (ROOT / pkg).rglob("*.py")]
    return {_module_name(f) for f in files if f.relative_to(ROOT).parts[0] in LIBRARY + ("scripts", "tests")}


def _private_imports(path: Path) -> list[str]:
    """``module.name`` of each private name (``_x``) ``path`` takes from another project module:
    imported by name, or read as an attribute of a project module it imported
    (``from scripts.bench import bench_peers as B`` ... ``B._model``)."""
    ours = LIBRARY + ("train", "scripts", "tests")
    tree, out, modules = _tree(path), [], {}
    is_module = _project_modules()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in ours:
            out += [
                f"{node.module}.{a.name}" for a in node.names if a.name.startswith("_") and not a.name.startswith("__")
            ]
            modules.update(
                {
                    a.asname or a.name: f"{node.module}.{a.name}"
                    for a in node.names
                    if f"{node.module}.{a.name}" in is_module
                }
            )
        elif isinstance(node, ast.Import):
            modules.update({a.asname: a.name for a in node.names if a.asname and a.name in is_module})
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in modules
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            out.append(f"{modules[node.value.id]}.{node.attr}")
    return out


def test_no_private_name_imported_from_another_file():
    bad = [f"{f.relative_to(ROOT)}: {name}" for f in _project_files() for name in _private_imports(f)]
    assert bad == []


def _imported_modules(path: Path) -> set[str]:
    """The dotted modules ``path`` imports (``from a.b import c``: a.b and a.b.c; ``import a.b``: a.b)."""
    out = set()
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return out


def _test_side_violations(path: Path) -> list[str]:
    """What ``path`` imports across the tests/scripts line: a test module imports no other test
    module (shared helpers live in tests.support), scripts import nothing of tests but
    tests.support."""
    rel = path.relative_to(ROOT)
    mods = _imported_modules(path)
    if rel.parts[0] == "tests":  # a test may import itself (to patch its own globals)
        return sorted(
            m
            for m in mods
            if m.startswith("tests.") and m.rsplit(".", 1)[-1].startswith("test_") and m != _module_name(path)
        )
    if rel.parts[0] == "scripts":
        return sorted(
            m
            for m in mods
            if (m == "tests" or m.startswith("tests.")) and not (m == "tests.support" or m.startswith("tests.support."))
        )
    return []


def test_tests_and_scripts_share_helpers_only_through_tests_support():
    bad = {str(f.relative_to(ROOT)): v for f in _project_files() if (v := _test_side_violations(f))}
    assert bad == {}


def _tool_internals(path: Path) -> list[str]:
    """``module.name`` of each name other than ``main`` that a test file imports from a user tool
    (a module directly under scripts/), and ``module`` where it imports the tool module itself."""
    tools = {f"scripts.{f.stem}" for f in (ROOT / "scripts").glob("*.py") if f.stem != "__init__"}
    bad = []
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in tools:
            bad += [f"{node.module}.{a.name}" for a in node.names if a.name != "main"]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == "scripts":
            bad += [f"scripts.{a.name}" for a in node.names if f"scripts.{a.name}" in tools]
        elif isinstance(node, ast.Import):
            bad += [a.name for a in node.names if a.name in tools]
    return bad


def test_tests_take_only_main_from_a_user_tool():
    bad = [
        f"{f.relative_to(ROOT)}: {name}" for f in sorted((ROOT / "tests").rglob("*.py")) for name in _tool_internals(f)
    ]
    assert bad == []


def test_the_test_side_rules_see_planted_violations(tmp_path, monkeypatch):
    """A test importing another test module, a script importing a test module, a private name
    imported from a script and a test taking more than ``main`` from a user tool are each caught."""
    (tmp_path / "tests" / "unit").mkdir(parents=True)
    (tmp_path / "scripts").mkdir()
    a = tmp_path / "tests" / "unit" / "test_a.py"
    a.write_text("from tests.layouts.test_train import BASE\nfrom scripts.plan import _status\n")
    b = tmp_path / "scripts" / "tool.py"
    b.write_text("from tests.layouts import test_train\nfrom tests.support.distributed import run_distributed\n")
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    assert _test_side_violations(a) == ["tests.layouts.test_train"]
    assert _test_side_violations(b) == ["tests.layouts", "tests.layouts.test_train"]
    assert _private_imports(a) == ["scripts.plan._status"]
    (tmp_path / "scripts" / "bench").mkdir(exist_ok=True)
    (tmp_path / "scripts" / "bench" / "bench_peers.py").write_text("def _model(x): ...\n")
    c = tmp_path / "tests" / "unit" / "test_c.py"
    c.write_text("from scripts.bench import bench_peers as B\nB._model(1)\nB.peer_model(1)\n")
    assert _private_imports(c) == ["scripts.bench.bench_peers._model"]
    (tmp_path / "scripts" / "plan.py").write_text("")
    (tmp_path / "scripts" / "bench").mkdir(exist_ok=True)
    (tmp_path / "scripts" / "bench" / "bench_peers.py").write_text("def _model(x): ...\n")
    c = tmp_path / "tests" / "unit" / "test_c.py"
    c.write_text("from scripts.plan import main, layouts\nfrom scripts import plan\nimport scripts.plan\n")
    assert _tool_internals(c) == ["scripts.plan.layouts", "scripts.plan", "scripts.plan"]


def test_importing_the_trainer_leaves_out_the_heavy_optional_modules():
    """Every rank, and the launcher's preflight, imports megazero.training:
    torch.distributed.checkpoint (with torch.distributed.tensor, about 1 s of CPU),
    torch._dynamo, tensorboard and the optional extras are imported where they are used, not
    with the trainer."""
    import subprocess
    import sys

    heavy = [
        "torch.distributed.checkpoint",
        "torch.distributed.tensor",
        "torch._dynamo",
        "torch.utils.tensorboard",
        "transformers",
        "wandb",
    ]
    code = "import sys, megazero.training; print(' '.join(m for m in sys.argv[1:] if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code, *heavy], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == []
