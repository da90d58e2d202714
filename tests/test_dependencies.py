"""DESIGN.md "Dependency direction": train.py -> model, data, megazero; model -> megazero;
megazero imports neither model nor data; data imports neither model nor megazero."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = {"megazero": {"model", "data", "train"}, "model": {"data", "train"}, "data": {"model", "megazero", "train"}}


def _imported_packages(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_follow_the_dependency_direction(package):
    files = sorted((ROOT / package).rglob("*.py"))
    assert files
    bad = {str(f.relative_to(ROOT)): sorted(_imported_packages(f) & FORBIDDEN[package]) for f in files}
    assert {f: b for f, b in bad.items() if b} == {}


def test_importing_train_leaves_out_the_heavy_optional_modules():
    """Every rank, and the launcher's preflight, imports train: torch.distributed.checkpoint
    (with torch.distributed.tensor, about 1 s of CPU), torch._dynamo, tensorboard and the
    optional extras are imported where they are used, not with train."""
    import subprocess
    import sys

    heavy = ["torch.distributed.checkpoint", "torch.distributed.tensor", "torch._dynamo",
             "torch.utils.tensorboard", "transformers", "wandb"]
    code = ("import sys, train; print(' '.join(m for m in sys.argv[1:] if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code, *heavy], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == []
