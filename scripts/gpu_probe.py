"""The measuring steps of ``scripts/gpu_check.sh`` (run through ``scripts/gpu_check.py``), one
subcommand each; every one prints ``gpu_check key NAME VALUE`` lines the runner puts in the
summary, and exits 1 when what it checks does not hold.

- ``versions``: torch, CUDA, cuDNN, NCCL, apex, the GPUs (``gpus`` key).
- ``mfu --block gpt2|llama``: a 1.3B-parameter GPT (24 layers, hidden 2048, 16 heads, seq 2048,
  vocabulary 50257; ``llama``: RoPE, RMSNorm, SwiGLU, 4 key/value groups, no biases, untied
  output) in bf16 through ``scripts/pretrain_gpt.sh``, 12 iterations of 8 sequences, iteration 10
  profiled (``torch.profiler`` trace, gzipped, under ``OUT/mfu-BLOCK/profile``), full
  recomputation under 60 GiB; then ``scripts/bench/run_throughput.py``'s line: tokens/s and MFU
  against the measured sustained matmul peak (the ``peak`` step's key in ``OUT/summary.json``)
  and against the data-sheet peak (``megazero.planning.flops``). ``--device cpu``: the small
  model instead, a smoke run of the probe.
- ``nccl-smoke`` (under torchrun, 2+ ranks): all-reduce, reduce-scatter and all-gather through
  ``megazero.collectives`` over NCCL against their closed-form results.
- ``layout --name N -- FLAGS``: a small fp32 GPT (``SMALL``) with ``FLAGS`` through
  ``pretrain_gpt.sh`` on the GPUs and again on CPU gloo ranks; the per-iteration losses agree
  to ``--rtol`` (relative; CUDA and CPU kernels sum in other orders). ``--device cpu`` compares
  CPU with itself, a smoke run of the probe.
- ``kernels``: (1) the SDPA kernel CUDA runs for each attention case megazero has (bf16 / fp32,
  grouped-query or not, causal or document-masked through
  ``megazero.context_parallel.attention.local_attention``), read off the profiler's operator
  and kernel names, a math (O(T^2) memory) fallback being a failure (DESIGN contract 6); (2)
  ``torch._grouped_mm`` against the per-expert loop in bf16 on CUDA, the layout
  ``model.moe`` stacks its experts in (a wrong product fails; a kernel that refuses the shapes
  is recorded); (3) host syncs per training step under
  ``torch.cuda.set_sync_debug_mode("warn")`` for a dense and an MoE model, against the budgets
  docs/performance.md gives for the CPU count; (4) one ring block (``--cp-comm-type p2p``)
  through the fused kernel against the einsum path, bf16 and fp32, causal and document-masked:
  differences and times (``ring_block_check``; not fused or beyond ``RING_BLOCK_TOL`` fails).
  Written to ``OUT/probes.json``. ``--device cpu --seq 64`` runs (1), (2) and (4) on CPU (its
  own flash kernel), to test the probe itself.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import subprocess
import sys
import warnings
from collections import Counter

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPE_1B3 = ["--num-layers", "24", "--hidden-size", "2048", "--num-attention-heads", "16", "--seq-length", "2048"]
SHAPE_1B3 += ["--vocab-size", "50257", "--micro-batch-size", "4", "--global-batch-size", "8"]
MFU_RUN = ["--train-iters", "12", "--log-interval", "1", "--lr", "1e-4", "--min-lr", "1e-5", "--mock-data", "--bf16"]
MFU_RUN += [
    "--kernels",
    "auto",
    "--eval-iters",
    "0",
    "--profile",
    "--profile-step-start",
    "10",
    "--profile-step-end",
    "11",
]
LLAMA = ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--group-query-attention"]
LLAMA += ["--num-query-groups", "4", "--disable-bias-linear", "--untie-embeddings-and-output-weights"]
SHAPE_SMALL = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64"]
SHAPE_SMALL += ["--vocab-size", "512", "--micro-batch-size", "2", "--global-batch-size", "8"]
SMALL = SHAPE_SMALL + ["--train-iters", "4", "--log-interval", "1", "--lr", "1e-3", "--seed", "7", "--mock-data"]
SMALL += ["--eval-iters", "0"]
RING_BLOCK_TOL = {"bfloat16": 0.1, "float32": 1e-3}
"""Largest |fused - einsum| of a ring block's out, lse, dq, dk, dv that ``kernels`` accepts: the
fused path rounds its output and probabilities to the input dtype, the einsums keep fp32."""


def key(name: str, value) -> None:
    """One key number for the summary (a value without spaces)."""
    print(f"gpu_check key {name} {str(value).replace(' ', '_')}", flush=True)


def versions(args) -> int:
    print("torch", torch.__version__, "| cuda", torch.version.cuda, "| cudnn", torch.backends.cudnn.version())
    key("torch", torch.__version__)
    key("gpus", torch.cuda.device_count())
    if not torch.cuda.is_available():
        print("no CUDA device visible: the GPU check needs a GPU machine")
        return 1
    print("nccl", ".".join(map(str, torch.cuda.nccl.version())))
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        print(
            f"gpu {i}: {p.name}, {p.total_memory / 2**30:.1f} GiB, sm_{p.major}{p.minor}, {p.multi_processor_count} SMs"
        )
    key("gpu0", torch.cuda.get_device_name(0))
    from megazero.ops.backend import apex_available, describe_backends  # after the GPU count: it may fail

    try:
        import apex

        print("apex", getattr(apex, "__version__", "installed"), "| CUDA extensions:", apex_available())
    except ImportError:
        print("apex not installed")
    print(describe_backends(torch.device("cuda", 0)))
    return 0


def _summary_key(out: str, name: str):
    try:
        with open(os.path.join(out, "summary.json"), encoding="utf-8") as f:
            steps = json.load(f)["steps"]
    except (OSError, ValueError, KeyError):
        return None
    return next((s["keys"][name] for s in steps if name in s.get("keys", {})), None)


def mfu(args) -> int:
    if args.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        gib, name, shape = props.total_memory >> 30, props.name, SHAPE_1B3
    else:  # a smoke run of this probe itself: the small model on CPU
        gib, name, shape = 0, None, SHAPE_SMALL
    peak = _summary_key(args.out, "matmul_sustained_tflops")
    run = os.path.join(os.path.abspath(args.out), f"mfu-{args.block}")
    shutil.rmtree(run, ignore_errors=True)
    flags = shape + MFU_RUN + (LLAMA if args.block == "llama" else []) + ["--device", args.device, "--run-dir", run]
    if args.device == "cuda" and gib < 60:
        flags += ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    if peak:
        flags += ["--peak-tflops", str(peak)]
    size = "1.3B" if shape is SHAPE_1B3 else "small"
    print(f"GPT {size} {args.block} on {name or args.device} ({gib} GiB), measured peak {peak or 'unknown'} TFLOP/s")
    sys.stdout.flush()
    rc = subprocess.call(["bash", os.path.join(ROOT, "scripts", "pretrain_gpt.sh")] + flags, cwd=ROOT)
    for here, _, files in os.walk(os.path.join(run, "profile")):
        for f in files:
            if f.endswith(".json"):
                path = os.path.join(here, f)
                with open(path, "rb") as src, gzip.open(path + ".gz", "wb") as dst:
                    shutil.copyfileobj(src, dst)
                os.remove(path)
                key("trace", os.path.relpath(path + ".gz", args.out))
    if rc != 0:
        print(f"the training run exited {rc}")
        return 1
    throughput = [sys.executable, "-m", "scripts.bench.run_throughput", run, "--skip", "3", "--dtype", "bf16"]
    throughput += (["--gpu-name", name] if name else []) + (["--measured-peak-tflops", str(peak)] if peak else [])
    return subprocess.call(throughput, cwd=ROOT)


def nccl_smoke(args) -> int:
    from datetime import timedelta

    import torch.distributed as dist

    from megazero import collectives

    local = int(os.environ["LOCAL_RANK"])
    dev = torch.device("cuda", local)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", timeout=timedelta(seconds=60), device_id=dev)
    group, rank, world = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    t = torch.full((8,), float(rank + 1), device=dev)
    collectives.all_reduce_sum(t, group)
    ok = bool(torch.all(t == world * (world + 1) / 2))
    full = torch.arange(4 * world, dtype=torch.float32, device=dev) * (rank + 1)
    shard = torch.empty(4, device=dev)
    collectives.reduce_scatter_sum(shard, full, group)
    want = torch.arange(4 * rank, 4 * rank + 4, dtype=torch.float32, device=dev) * world * (world + 1) / 2
    ok &= torch.equal(shard, want)
    out = torch.empty(4 * world, device=dev)
    collectives.all_gather_into(out, torch.full((4,), float(rank), device=dev), group)
    ok &= torch.equal(out, torch.arange(world, device=dev).float().repeat_interleave(4))
    torch.cuda.synchronize()
    print(f"rank {rank}: NCCL collectives {'ok' if ok else 'WRONG'} on {world} ranks", flush=True)
    dist.destroy_process_group()
    return 0 if ok else 1


def _losses(run_dir: str) -> list[float]:
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
        return [r["loss"] for r in map(json.loads, filter(str.strip, f)) if r.get("kind") == "train"]


def layout(args) -> int:
    runs = {}
    for side, device in (("cuda", args.device), ("cpu", "cpu")):
        run = os.path.join(os.path.abspath(args.out), f"layout-{args.name}", side)
        shutil.rmtree(run, ignore_errors=True)
        cmd = ["bash", os.path.join(ROOT, "scripts", "pretrain_gpt.sh")] + SMALL + args.flags
        rc = subprocess.call(cmd + ["--device", device, "--run-dir", run], cwd=ROOT)
        if rc != 0:
            print(f"layout {args.name} on {device} exited {rc}")
            return 1
        runs[side] = _losses(run)
    gpu, cpu = runs["cuda"], runs["cpu"]
    worst = max(abs(g - c) / abs(c) for g, c in zip(gpu, cpu)) if gpu and len(gpu) == len(cpu) else float("inf")
    print(f"layout {args.name}: losses cuda {gpu}, cpu {cpu}, largest relative difference {worst:.2e}")
    key("max_rel_diff", f"{worst:.2e}")
    return 0 if worst <= args.rtol else 1


def _sdpa_backend(names: list[str]) -> str:
    """The SDPA implementation the profiled operator and kernel names show: the dispatcher's
    ``aten::_scaled_dot_product_{flash,efficient,cudnn}_attention`` (or their kernels'
    ``flash`` / ``fmha`` / ``cudnn`` names), else ``math`` (softmax of the full T x T scores)."""
    low = " ".join(names).lower()
    for backend, marks in (("cudnn", ("cudnn",)), ("flash", ("flash",)), ("efficient", ("efficient", "fmha"))):
        if any(m in low for m in marks):
            return backend
    return "math"


def sdpa_cases(device: torch.device, seq: int = 2048) -> list[dict]:
    """Forward and backward of ``local_attention`` at B 2, 16 heads, T ``seq``, d 128 for each
    dtype x GQA x document mask: the attention operators and kernels the profiler saw and the
    backend they show."""
    from torch.profiler import ProfilerActivity, profile

    from megazero.context_parallel.attention import local_attention

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    marks = ("attn", "attention", "fmha", "flash", "sdpa")
    cases = []
    for dtype in (torch.bfloat16, torch.float32):
        for groups in (16, 4):
            for docs in (False, True):
                q = torch.randn(2, 16, seq, 128, device=device, dtype=dtype, requires_grad=True)
                k, v = (torch.randn(2, groups, seq, 128, device=device, dtype=dtype, requires_grad=True) for _ in "kv")
                seg = (
                    torch.arange(seq, device=device).div(seq // 4, rounding_mode="floor").expand(2, -1)
                    if docs
                    else None
                )
                local_attention(q, k, v, segment_ids=seg).sum().backward()  # warm-up
                with profile(activities=activities) as prof:
                    local_attention(q, k, v, segment_ids=seg).sum().backward()
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                names = sorted({e.name for e in prof.events()})
                attn = [n for n in names if any(m in n.lower() for m in marks) and "aten::scaled_dot" not in n]
                case = f"{str(dtype)[6:]}-{'gqa' if groups < 16 else 'mha'}-{'docs' if docs else 'causal'}"
                cases.append(dict(case=case, backend=_sdpa_backend(attn), names=attn[:8]))
                print(f"sdpa {case}: {cases[-1]['backend']} ({', '.join(attn[:3]) or 'no attention operator'})")
    return cases


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest |a - b| with -inf taken as 0 on both sides; inf when the -inf rows or NaNs differ."""
    if not torch.equal(torch.isneginf(a), torch.isneginf(b)) or a.isnan().any() or b.isnan().any():
        return float("inf")
    return (a.nan_to_num(neginf=0.0).double() - b.nan_to_num(neginf=0.0).double()).abs().max().item()


def _median_ms(fn, device: torch.device, reps: int = 3) -> float:
    import time

    fn()  # warm-up
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(1e3 * (time.perf_counter() - start))
    return sorted(times)[len(times) // 2]


def ring_block_check(device: torch.device, seq: int = 2048) -> list[dict]:
    """One ring block ``[B 2, G 4, R 2, seq, d 128]`` through the fused path
    (``fused_blocks.block_path``: CUDA's efficient kernel, CPU's flash kernel) against the einsum
    path (``blockwise``), bf16 and fp32, as the causal diagonal block and as a document-masked
    off-diagonal block whose last quarter of query rows sees no key: max |difference| of out,
    lse, and dq, dk, dv (both backwards given the einsum's out and lse), and the median time
    of forward + backward on each path (ms)."""
    from megazero.context_parallel import blockwise as bw
    from megazero.context_parallel import fused_blocks as fb

    g = torch.Generator().manual_seed(0)
    docs = torch.arange(seq).div(max(seq // 4, 1), rounding_mode="floor")
    cases = []
    for dtype in (torch.bfloat16, torch.float32):
        q, do = (torch.randn(2, 4, 2, seq, 128, generator=g).to(device, dtype) for _ in "qo")
        k, v = (torch.randn(2, 4, seq, 128, generator=g).to(device, dtype) for _ in "kv")
        for name in ("causal", "docs"):
            causal = name == "causal"
            mask = torch.ones(seq, seq, dtype=torch.bool).tril() if causal else (docs + 1)[:, None] == docs[None, :]
            mask, scale = mask[None].to(device), 128**-0.5  # (1, T, T)
            out, lse = bw.block_attention(q, k, v, mask, scale)
            y = out.to(dtype)
            delta = (do.to(out.dtype) * y.to(out.dtype)).sum(-1)
            grads = bw.block_attention_backward(q, k, v, do, delta, lse, mask, scale)
            f_out, f_lse = fb.fused_block_attention(q, k, v, mask, scale, causal=causal)
            f_grads = fb.fused_block_attention_backward(q, k, v, do, y, lse, mask, scale, causal=causal)
            diffs = {
                n: _max_diff(a, b)
                for n, a, b in zip(("out", "lse", "dq", "dk", "dv"), (f_out, f_lse, *f_grads), (out, lse, *grads))
            }
            ms = {
                "einsum": _median_ms(
                    lambda: bw.block_attention_backward(
                        q, k, v, do, delta, bw.block_attention(q, k, v, mask, scale)[1], mask, scale
                    ),
                    device,
                ),
                "fused": _median_ms(
                    lambda: fb.fused_block_attention_backward(
                        q,
                        k,
                        v,
                        do,
                        y,
                        fb.fused_block_attention(q, k, v, mask, scale, causal=causal)[1],
                        mask,
                        scale,
                        causal=causal,
                    ),
                    device,
                ),
            }
            case = f"{str(dtype)[6:]}_{name}"
            cases.append(dict(case=case, path=fb.block_path(q), max_abs_diff=diffs, ms=ms))
            print(f"ring block {case}: path {cases[-1]['path']}, max |diff| {diffs}, fwd+bwd ms {ms}")
    return cases


def grouped_mm_check(device: torch.device) -> dict:
    """``torch._grouped_mm`` of 8 experts (rows ``[S, H]``, weights ``[8, F, H]`` stacked and
    transposed as ``model.moe`` does) against the per-expert ``x @ w.T`` loop in bf16, with
    uneven experts and with an expert that gets no row: per case ``equal`` (bitwise),
    ``close`` (within 1e-2 of the largest output), ``differs`` or ``error: ...``."""
    if not hasattr(torch, "_grouped_mm"):
        return {"uneven": "error: torch has no _grouped_mm"}
    gen = torch.Generator(device=device).manual_seed(0)
    w = torch.randn(8, 2816, 1024, device=device, dtype=torch.bfloat16, generator=gen) / 32
    report = {}
    for case, sizes in (
        ("uneven", [16, 200, 56, 512, 8, 128, 64, 56]),
        ("empty-expert", [0, 200, 56, 512, 8, 128, 64, 72]),
    ):
        rows = torch.randn(sum(sizes), 1024, device=device, dtype=torch.bfloat16, generator=gen)
        offs = torch.tensor(sizes, device=device).cumsum(0).to(torch.int32)
        try:
            got = torch._grouped_mm(rows, w.transpose(1, 2), offs=offs)  # (S, F)
        except RuntimeError as e:
            report[case] = "error: " + str(e).splitlines()[0][:200]
            continue
        want = torch.cat([part @ w[j].T for j, part in enumerate(rows.split(sizes))])  # (S, F)
        err = (got.float() - want.float()).abs().max().item()
        close = err <= 1e-2 * want.float().abs().max().item()
        report[case] = "equal" if torch.equal(got, want) else "close" if close else f"differs (max abs {err:.3g})"
    return report


PROBE = "the probe itself"  # a sync reached from scripts/ (the debug-mode switch), not from a training step


def _our_frame(stack) -> str:
    """``path:line`` of the innermost frame of ``stack`` (a ``traceback.extract_stack()``) in
    megazero's code (``megazero/``, ``model/``, ``data/``), followed by ``<- torch/...:line`` when
    a library frame sits inside it (the place a warning names is where the C++ call came from,
    often inside torch itself); :data:`PROBE` when none is in megazero's code."""
    inner = stack[-1]
    for frame in reversed(stack):
        path = os.path.abspath(frame.filename)
        rel = os.path.relpath(path, ROOT)
        if os.path.isfile(path) and rel.split(os.sep)[0] in ("megazero", "model", "data"):
            mine = f"{rel}:{frame.lineno}"
            if frame is inner:
                return mine
            lib = inner.filename.split("site-packages" + os.sep)[-1]
            return f"{mine} <- {lib}:{inner.lineno}"
    return PROBE


def sync_count(device: torch.device, extra: list[str]) -> dict:
    """Host syncs per step of ``SMALL + extra`` on ``device``: the warnings of
    ``torch.cuda.set_sync_debug_mode("warn")`` over 2 steps after 2 warm-up steps, by place (the
    innermost frame in megazero's code: :func:`_our_frame`; one reached only from the probe, as the
    first H200 run found ``set_sync_debug_mode``'s own, is listed but not counted)."""
    import traceback

    from megazero.training import build_trainer

    trainer = build_trainer(SMALL + extra + ["--device", "cuda"], 1, device=device)
    for _ in range(2):
        trainer.train_step(trainer.next_batches())
    torch.cuda.synchronize(device)
    places: Counter = Counter()

    def seen(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            stack = traceback.extract_stack()[:-1]  # less this hook
            while stack and os.path.basename(stack[-1].filename) == "warnings.py":
                stack.pop()
            places[_our_frame(stack)] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = seen
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(2):
                trainer.train_step(trainer.next_batches())
        finally:
            torch.cuda.set_sync_debug_mode(0)
    counted = sum(n for place, n in places.items() if place != PROBE)  # the switch of the debug mode is not a step's
    return dict(per_step=counted / 2, places=dict(places.most_common(12)))


def kernels(args) -> int:
    device = torch.device(args.device)
    report, failures = {}, []
    probes = (("sdpa", lambda d: sdpa_cases(d, args.seq)), ("grouped_mm", grouped_mm_check))
    for name, fn in probes + (("ring_block", lambda d: ring_block_check(d, args.seq)),):
        try:
            report[name] = fn(device)
        except Exception as e:  # a probe that breaks is recorded and the others still run
            report[name] = dict(error=f"{type(e).__name__}: {e}"[:300])
            failures.append(f"{name}: {report[name]['error']}")
    for case in report["sdpa"] if isinstance(report["sdpa"], list) else []:
        key(f"sdpa_{case['case'].replace('-', '_')}", case["backend"])
        if case["backend"] == "math":
            failures.append(f"sdpa {case['case']} takes the math kernel (O(T^2) memory)")
    for case, verdict in report["grouped_mm"].items():  # an error is a finding; a wrong product fails
        key(f"grouped_mm_bf16_{case.replace('-', '_')}", verdict.split(":")[0].split()[0])
        if verdict.startswith("differs"):
            failures.append(f"grouped_mm {case}: {verdict}")
    for case in report["ring_block"] if isinstance(report["ring_block"], list) else []:
        name, diffs = f"ring_block_{case['case']}", case["max_abs_diff"]
        key(f"{name}_path", case["path"])
        key(f"{name}_max_abs_diff", ",".join(f"{n}={x:.2e}" for n, x in diffs.items()))
        key(f"{name}_ms", ",".join(f"{n}={x:.1f}" for n, x in case["ms"].items()))
        bound = RING_BLOCK_TOL[case["case"].split("_")[0]]
        unfused = case["path"] == "einsum" and device.type == "cuda"  # CPU keeps 16-bit blocks on einsums
        if unfused or max(diffs.values()) > bound:  # not fused on the GPU, or not the same attention
            failures.append(f"ring block {case['case']}: path {case['path']}, max |diff| {max(diffs.values()):.2e}")
    micro = 4  # SMALL: global batch 8 of micro-batches of 2
    layers = 4  # SMALL's, every one an MoE layer in the MoE model
    moe = ["--num-experts", "4", "--moe-router-topk", "2"]
    # docs/performance.md, "Host syncs per step": dense 2; MoE the dense 2, one per MoE layer and
    # micro-batch (the rows per expert) and one for the routing statistics
    budgets = {"dense": ([], 2), "moe": (moe, 2 + layers * micro + 1)}
    for name, (extra, budget) in budgets.items() if device.type == "cuda" else ():  # sync debug: CUDA only
        try:
            report[f"syncs_{name}"] = counted = sync_count(device, extra)
        except Exception as e:
            report[f"syncs_{name}"] = dict(error=f"{type(e).__name__}: {e}"[:300])
            failures.append(f"syncs_{name}: {report[f'syncs_{name}']['error']}")
            continue
        key(f"syncs_per_step_{name}", counted["per_step"])
        print(f"host syncs per step, {name}: {counted['per_step']} (budget {budget}); by place {counted['places']}")
        if counted["per_step"] > budget:
            failures.append(f"{name}: {counted['per_step']} host syncs per step, budget {budget}")
    with open(os.path.join(args.out, "probes.json"), "w", encoding="utf-8") as f:
        json.dump(dict(report, failures=failures), f, indent=1)
    for failure in failures:
        print("FAILED:", failure)
    return 1 if failures else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    sub.add_parser("versions")
    sub.add_parser("nccl-smoke")
    p = sub.add_parser("mfu")
    p.add_argument("--block", choices=("gpt2", "llama"), required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda", help="cpu: the small model, a smoke run of the probe itself")
    p = sub.add_parser("layout")
    p.add_argument("--name", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--rtol", type=float, default=1e-4)
    p.add_argument("--device", default="cuda", help="the side compared with CPU ranks (cpu: a smoke run of the probe)")
    p.add_argument("flags", nargs=argparse.REMAINDER)
    p = sub.add_parser("kernels")
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda", help="cpu: the SDPA and grouped GEMM probes on CPU (no sync count)")
    p.add_argument("--seq", type=int, default=2048, help="sequence length of the attention cases")
    args = ap.parse_args(argv)
    if getattr(args, "flags", None) and args.flags[0] == "--":
        args.flags = args.flags[1:]
    fn = {"versions": versions, "nccl-smoke": nccl_smoke, "mfu": mfu, "layout": layout, "kernels": kernels}
    return fn[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
