"""Device lint: no tensor of the library is made on the CPU by accident.

NCCL has no CPU transport, so a tensor that a factory call leaves on the default device (the
CPU) and that then reaches a collective ends the run on a GPU cluster, while the CPU suite's
gloo takes it happily (the pipeline handshake's settings vector, the evaluation's
token counts). This test reads the source (``ast``, nothing is imported) of ``megazero/``,
``model/`` and ``train.py`` and requires of every tensor factory call
(``torch.tensor``, ``zeros``, ``empty``, ``full``, ``arange``, ``rand*``, ...; the ``*_like``
and ``Tensor.new_*`` forms inherit their input's device and are not factories here):

1. it passes ``device=``, and a literal CPU device (``"cpu"``, ``torch.device("cpu")``) only in
   a function listed in ``HOST_TENSORS`` with the reason the tensor is meant for host memory
   (a host tensor names the CPU: without ``device=`` it would follow the default device);
2. ``torch.from_numpy`` (always host memory) is followed at once by ``.to(...)`` or is in a
   function listed in ``HOST_TENSORS``;
3. a factory used other than by a direct call (``(torch.zeros if a else torch.ones)(...)``) is
   checked at the call it selects; any other use is reported;
4. no dataclass field defaults to a CPU device (``device: torch.device = torch.device("cpu")``):
   a default hides the forgotten argument until NCCL refuses the tensor.

The allowlist is keyed by file and enclosing function (``Class.method``), not line numbers,
and an entry that matches nothing fails too, so the list stays short and true. The dynamic
counterpart runs the trainer and the pipeline handshake with ``torch.device("meta")`` as the
default device and the real device passed explicitly (tests/layouts/test_train.py,
tests/layouts/test_pipeline.py): a factory that forgot ``device=`` then makes a meta tensor, which gloo
refuses.
"""

from __future__ import annotations

import ast
import pathlib

from tests.support.paths import REPO

ROOT = REPO
SCANNED = ("megazero", "model", "train.py")

FACTORIES = frozenset(
    {
        "tensor",
        "as_tensor",
        "from_numpy",
        "zeros",
        "ones",
        "empty",
        "full",
        "arange",
        "linspace",
        "logspace",
        "eye",
        "rand",
        "randn",
        "randint",
        "randperm",
        "empty_strided",
        "scalar_tensor",
        "normal",
    }
)

#: (file, enclosing function) -> why its tensors live in host memory on purpose.
HOST_TENSORS = {
    # NVMe offload (ZeRO-Infinity): the optimizer state lives in swap files and host buffers; a
    # checkpoint reads it whole into host memory, as cpu offload keeps it there.
    ("megazero/optim/nvme.py", "NvmeOffloadOptimizer._swap_in"): "the swapped optimizer state, read for a checkpoint",
    # ZeRO-3 parameter shards on NVMe: a shard is built in host memory, written to its swap file
    # and read back into host slots (megazero/offload/param_swap.py)
    ("megazero/data_parallel/zero3.py", "Stage3.init_params"): "a ZeRO-3 parameter shard kept in a swap file",
    # Hugging Face export: the tensors written to a safetensors file are host tensors.
    ("model/hf_moe.py", "extra_tensors"): "Qwen2-MoE's zero shared-expert gates, written to a file",
    ("model/hf_deepseek.py", "bias_tensors"): "DeepSeek-V3's router correction biases, written to a file",
    # Layout-invariant initialisation (docs/design.md, contract 6): every full weight is drawn
    # by a CPU generator seeded from (seed, name), so its values do not depend on the device;
    # the caller keeps this rank's partition and moves it to the device.
    ("model/spec.py", "InitialWeights.__getitem__"): "full weights from a seeded CPU generator",
    # The full (unsharded) tensors of a checkpoint, read in one process for generate.py and
    # convert_checkpoint.py: the host holds them; the model takes its partitions from them.
    ("megazero/checkpoint/core.py", "read_full_tensors"): "full checkpoint tensors read into host memory",
    # A view of a host tensor's own storage for DCP's file writer (the tensor is on the CPU).
    ("megazero/checkpoint/shards.py", "compact_view"): "an empty CPU tensor re-pointed at a host storage",
    # One exactly-sized host allocation per offloaded buffer, page-locked in place on CUDA.
    ("megazero/offload/host_memory.py", "HostArena.__init__"): "an offload arena in host memory",
    # A tensor-parallel rank's partitions assembled from a checkpoint's saved pieces (generate/evaluate).
    ("megazero/checkpoint/core.py", "read_partitions"): "this rank's partitions read into host memory",
    # The grouped GEMM's offsets: built from a Python list on the host, then copied (pinned on CUDA).
    ("model/moe.py", "group_offsets"): "the group offsets before their copy to the device",
    # Rollout noise: each row's Gumbel noise comes from its own keyed CPU generator, so the draw
    # does not depend on the device; it is moved to the logits' device at once.
    ("megazero/post_training/rollout.py", "choose_with_log_probs"): "per-row Gumbel noise from a keyed CPU generator",
    # The grouped-GEMM check draws its inputs from a seeded CPU generator, then moves them.
    ("model/moe.py", "grouped_matches_loop"): "a seeded CPU draw of the check's inputs",
}


#: the findings an allowlisted function may have: host tensors that say so. A factory without
#: ``device=`` stays a finding there too: it follows the default device (``torch.set_default_device``,
#: ``with torch.device(...)``), which a host tensor must not.
HOST_FORMS = ("on a literal CPU device", "torch.from_numpy makes a host tensor: add .to(device)")


def _is_torch_attr(node: ast.AST) -> str | None:
    """``torch.NAME`` -> NAME for a factory name, else None."""
    if (
        isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "torch"
        and node.attr in FACTORIES
    ):
        return node.attr
    return None


def _is_cpu_literal(node: ast.AST) -> bool:
    """``"cpu"`` / ``"cpu:0"`` or ``torch.device("cpu"...)``."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value.split(":")[0] == "cpu"
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "device"
        and bool(node.args)
        and _is_cpu_literal(node.args[0])
    )


class _Scanner(ast.NodeVisitor):
    """Collects ``(qualified function, line, problem)`` of one file."""

    def __init__(self):
        self.scope: list[str] = []
        self.parents: dict[ast.AST, ast.AST] = {}
        self.found: list[tuple[str, int, str]] = []
        self.checked: set[int] = set()  # ids of torch.FACTORY nodes seen as a call's callee

    def visit_FunctionDef(self, node):
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_ClassDef(self, node):
        if any(
            (isinstance(d, ast.Name) and d.id == "dataclass")
            or (isinstance(d, ast.Attribute) and d.attr == "dataclass")
            or (isinstance(d, ast.Call) and getattr(d.func, "id", getattr(d.func, "attr", None)) == "dataclass")
            for d in node.decorator_list
        ):
            self._dataclass_fields(node)
        self.visit_FunctionDef(node)

    def _dataclass_fields(self, node: ast.ClassDef) -> None:
        for item in node.body:
            if isinstance(item, ast.AnnAssign) and item.value is not None:
                default = item.value
                if (
                    isinstance(default, ast.Call)
                    and getattr(default.func, "id", getattr(default.func, "attr", None)) == "field"
                ):
                    default = next((k.value for k in default.keywords if k.arg == "default"), None)
                if default is not None and _is_cpu_literal(default):
                    name = item.target.id if isinstance(item.target, ast.Name) else "?"
                    self.found.append(
                        (node.name, item.lineno, f"dataclass field {node.name}.{name} defaults to a CPU device")
                    )

    def _report(self, line: int, problem: str) -> None:
        self.found.append((".".join(self.scope) or "<module>", line, problem))

    def visit_Call(self, node: ast.Call):
        callees = [node.func]
        if isinstance(node.func, ast.IfExp):
            callees = [node.func.body, node.func.orelse]
        for callee in callees:
            name = _is_torch_attr(callee)
            if name is not None:
                self.checked.add(id(callee))
                self._check_call(node, name)
        self.generic_visit(node)

    def _check_call(self, node: ast.Call, name: str) -> None:
        if name == "from_numpy":
            parent = self.parents.get(node)
            moved = (
                isinstance(parent, ast.Attribute)
                and parent.attr == "to"
                and isinstance(self.parents.get(parent), ast.Call)
            )
            if not moved:
                self._report(node.lineno, "torch.from_numpy makes a host tensor: add .to(device)")
            return
        device = next((k.value for k in node.keywords if k.arg == "device"), None)
        if device is None:
            self._report(node.lineno, f"torch.{name} without device=")
        elif _is_cpu_literal(device):
            self._report(node.lineno, f"torch.{name} on a literal CPU device")

    def visit_Attribute(self, node: ast.Attribute):
        if _is_torch_attr(node) and id(node) not in self.checked and not isinstance(self.parents.get(node), ast.Call):
            self._report(node.lineno, f"torch.{node.attr} used other than by a call")
        self.generic_visit(node)

    def visit_ImportFrom(self, node: ast.ImportFrom):
        if node.module == "torch":
            for a in node.names:
                if a.name in FACTORIES:
                    self._report(node.lineno, f"'from torch import {a.name}' hides a factory from this lint")


def scan_source(text: str) -> list[tuple[str, int, str]]:
    """Every finding of one file's source: ``(enclosing function, line, problem)``."""
    tree = ast.parse(text)
    s = _Scanner()
    for parent in ast.walk(tree):
        for child in ast.iter_child_nodes(parent):
            s.parents[child] = parent
    # visit calls before bare attributes: a callee is marked before visit_Attribute sees it
    s.visit(tree)
    return s.found


def _files() -> list[pathlib.Path]:
    out = []
    for name in SCANNED:
        p = ROOT / name
        out += sorted(p.rglob("*.py")) if p.is_dir() else [p]
    return out


def lint() -> tuple[list[str], set]:
    """(findings not on the allowlist as ``file:line function: problem``, allowlist keys used)."""
    problems, used = [], set()
    for path in _files():
        rel = path.relative_to(ROOT).as_posix()
        for func, line, problem in scan_source(path.read_text()):
            key = (rel, func)
            if key in HOST_TENSORS and problem.endswith(HOST_FORMS):
                used.add(key)
                continue
            problems.append(f"{rel}:{line} {func}: {problem}")
    return problems, used


def test_every_tensor_factory_names_its_device():
    problems, used = lint()
    assert not problems, (
        "tensor factory calls that leave their tensor on the CPU (NCCL cannot send it): pass "
        "device=, or, for a tensor meant for host memory, add (file, function) with the reason to "
        "HOST_TENSORS in tests/unit/test_device_lint.py:\n  " + "\n  ".join(problems)
    )
    stale = sorted(set(HOST_TENSORS) - used)
    assert not stale, f"HOST_TENSORS entries that match no host tensor any more (remove them): {stale}"


def test_the_lint_sees_each_kind_of_mistake():
    """Each rule on a small source (the lint is only as good as what it can see)."""
    src = """
import torch
from dataclasses import dataclass, field

@dataclass
class Links:
    device: torch.device = torch.device("cpu")
    other: str = field(default="cpu")
    fine: torch.device = None

def f(x, dev):
    a = torch.tensor([1], dtype=torch.int64)
    b = torch.zeros(3, device=dev)
    c = torch.from_numpy(x)
    d = torch.from_numpy(x).to(dev)
    e = (torch.zeros if x else torch.ones)(3)
    g = torch.empty(2, device="cpu")
    h = torch.zeros_like(b)
    make = torch.arange
"""
    found = [(f, p) for f, _, p in scan_source(src)]
    assert found == [
        ("Links", "dataclass field Links.device defaults to a CPU device"),
        ("Links", "dataclass field Links.other defaults to a CPU device"),
        ("f", "torch.tensor without device="),
        ("f", "torch.from_numpy makes a host tensor: add .to(device)"),
        ("f", "torch.zeros without device="),
        ("f", "torch.ones without device="),
        ("f", "torch.empty on a literal CPU device"),
        ("f", "torch.arange used other than by a call"),
    ], found
