"""One switch that picks the kernels for LayerNorm, RMSNorm and Adam (the ``--kernels`` setting).

Backends, fastest first:

- ``"apex"``: NVIDIA apex's fused CUDA kernels (``apex.normalization.fused_layer_norm``,
  ``amp_C.multi_tensor_adam``). CUDA only, and only when apex was built with its C++/CUDA
  extensions.
- ``"torch"``: torch's own kernels (``torch.nn.functional.layer_norm`` / ``rms_norm``,
  ``torch._fused_adamw_``, the kernel behind ``torch.optim.AdamW(fused=True)``), on any device.
- ``"reference"``: the formulas written out in plain tensor math; the test oracle.

``"auto"`` picks apex when it is importable and the device is CUDA, else torch; the reference
backend is used only when asked for by name.
"""

from __future__ import annotations

import functools
import importlib

import torch

BACKENDS = ("auto", "apex", "torch", "reference")


@functools.lru_cache(maxsize=None)
def apex_available() -> bool:
    """True when apex and its compiled extensions (``fused_layer_norm_cuda``, ``amp_C``) import."""
    try:
        importlib.import_module("apex.normalization.fused_layer_norm")
        importlib.import_module("apex.multi_tensor_apply")
        importlib.import_module("fused_layer_norm_cuda")
        importlib.import_module("amp_C")
    except Exception:  # apex may fail with ImportError, OSError or a RuntimeError of its own
        return False
    return True


def select_backend(requested: str, device: torch.device) -> str:
    """Resolve a ``--kernels`` request to the backend that will actually run.

    Args:
        requested: one of ``"auto"``, ``"apex"``, ``"torch"``, ``"reference"``.
        device: the device the kernels will run on (``torch.device("cpu")``, ``"cuda:0"``...).

    Returns:
        ``"apex"``, ``"torch"`` or ``"reference"``. ``"auto"`` gives ``"apex"`` when apex is
        importable and ``device`` is CUDA, else ``"torch"``.

    Raises:
        ValueError: ``requested`` is not a known backend, or ``"apex"`` was requested where apex
            cannot run (not installed, or a non-CUDA device); the message names ``--kernels``
            and the fix.
    """
    device = torch.device(device)
    if requested not in BACKENDS:
        raise ValueError(f"--kernels {requested!r} is not a kernel backend; choose one of {', '.join(BACKENDS)}")
    if requested == "auto":
        return "apex" if device.type == "cuda" and apex_available() else "torch"
    if requested == "apex":
        if device.type != "cuda":
            raise ValueError(
                f"--kernels apex needs a CUDA device, but the device is {device}; "
                "use --kernels torch (or auto) on this machine"
            )
        if not apex_available():
            raise ValueError(
                "--kernels apex was requested but apex with its CUDA extensions "
                "(fused_layer_norm_cuda, amp_C) is not importable; install apex built with "
                "--cpp_ext --cuda_ext, or use --kernels torch (or auto)"
            )
    return requested


def describe_backends(device: torch.device, requested: str = "auto") -> str:
    """One start-up log line naming the kernels in use for LayerNorm, RMSNorm and Adam.

    Raises:
        ValueError: as :func:`select_backend`.
    """
    backend = select_backend(requested, device)
    kernels = {
        "apex": (
            "apex fused_layer_norm_affine",
            "apex fused_rms_norm_affine",
            "apex amp_C.multi_tensor_adam (adam_w_mode)",
        ),
        "torch": ("torch.nn.functional.layer_norm", "torch.nn.functional.rms_norm", "torch._fused_adamw_"),
        "reference": ("reference (plain tensor math)",) * 3,
    }[backend]
    return (
        f"kernels: {backend} (requested {requested}, device {torch.device(device)}): "
        f"LayerNorm={kernels[0]}, RMSNorm={kernels[1]}, Adam={kernels[2]}"
    )
