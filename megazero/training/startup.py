"""Start-up: everything that can fail before the first collective (settings, device, data,
checkpoint, memory plan; contract 3), the launcher's preflight, and the process groups."""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from data.indexed_dataset import DataError
from data.run_data import RunData
from megazero import checkpoint
from megazero.config import Config, config_from_argv, layout_topology
from megazero.context_parallel.sdpa_kernels import CudaPlatform
from megazero.offload.swap_dirs import NvmePathError, check_nvme_path, sweep_stale
from megazero.planning import memory
from megazero.planning.plan import attention_math_warning, nvme_swap_bytes, plan_memory, zero3_live_warning
from megazero.post_training.rewards import RewardError, parse_reward, reward_model_dir
from megazero.process_groups import ProcessGroups
from megazero.runtime import flight_recorder
from megazero.runtime.extras import MissingExtra
from megazero.runtime.launch import (
    DeviceError,
    Launch,
    check_device,
    launch_exports,
    max_connections_warning,
    uses_cuda,
)
from megazero.training.evaluation import check_harness
from megazero.training.inference import check_reward_model
from megazero.training.inputs import build_data, data_signature, tokenizer_digest, tokenizer_record
from model.build import build_gpt_config, check_from_hf, model_signature
from model.evaluation import HarnessError


def setup_groups(cfg: Config, launch: Launch, device: torch.device) -> ProcessGroups:
    """NCCL on ``device`` (bound by ``bind_device``) when it is a GPU, else gloo; every group of
    the layout. On CUDA first the flight recorder's variables (megazero/runtime/flight_recorder.py,
    read when NCCL's process group is created) and the CUDA_DEVICE_MAX_CONNECTIONS check."""
    use_cuda = device.type == "cuda"
    if use_cuda:
        flight_recorder.enable(cfg.log.run_dir, os.environ)
        warning = max_connections_warning(cfg, os.environ)
        if warning and launch.rank == 0:
            print(f"megazero: warning: {warning}", file=sys.stderr, flush=True)
    if launch.world_size > 1:
        timeout = timedelta(seconds=cfg.parallel.distributed_timeout_s)
        dist.init_process_group(
            "nccl" if use_cuda else "gloo",
            rank=launch.rank,
            world_size=launch.world_size,
            timeout=timeout,
            store=restart_store(timeout),
            device_id=device if use_cuda else None,
        )
    return ProcessGroups.build(layout_topology(cfg), timeout_s=cfg.parallel.distributed_timeout_s)


def restart_store(timeout: timedelta):
    """After torchrun restarted the group: its agent's store under a key prefix of this attempt.

    torchrun's static rendezvous keeps one store for every attempt, so without a prefix the
    restarted ranks read the dead attempt's gloo addresses and time out ("Connection refused").
    None (torch's own env:// store) on the first attempt or when the agent hosts no store.
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or attempt == "0":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
    return dist.PrefixStore(f"megazero/attempt_{attempt}", store)


def check_resume(cfg: Config, resume: Optional[dict], vocab_size: int, flag: str = "--load") -> None:
    """Raise CheckpointError naming the first model size that differs from the checkpoint's
    (``resume``, read from ``flag``'s directory: --load, or --ref-load's reference)."""
    if resume is None:
        return
    path = cfg.post.ref_load if flag == "--ref-load" else cfg.train.load
    saved, mine = resume["extra"].get("model", {}), model_signature(build_gpt_config(cfg, vocab_size))
    for key, value in mine.items():
        if key in saved and saved[key] != value:
            raise checkpoint.CheckpointError(
                f"{flag} {path}: the checkpoint has {key} = {saved[key]}, this model {value}; "
                f"fix: use the model settings the checkpoint was saved with, or another {flag}"
            )
    was, now = (resume["extra"].get("data") or {}).get("tokenizer"), tokenizer_digest(cfg.data.tokenizer_model)
    if was and now and was != now:  # same vocabulary size, other token meanings: the weights would not fit
        raise checkpoint.CheckpointError(
            f"{flag} {path} was trained with another tokenizer (sha256 {was[:12]}) than "
            f"--tokenizer-model {cfg.data.tokenizer_model} (sha256 {now[:12]}); fix: the tokenizer it was trained with"
        )
    was, now = (resume["extra"].get("tokenizer") or {}).get("fim"), (tokenizer_record(cfg) or {}).get("fim")
    if was and now and was != now:  # the sentinels' rows of the embedding would mean other tokens
        raise checkpoint.CheckpointError(
            f"{flag} {path} was trained with the FIM sentinels {was}, this run has {now}; fix: the "
            "--fim-tokens and tokenizer it was trained with"
        )


def resume_warnings(cfg: Config, resume: Optional[dict]) -> list[str]:
    """What a resume from ``resume`` (a checkpoint's meta) will not do as the user may expect."""
    if resume is None:
        return []
    out = []
    if resume["iteration"] >= cfg.train.train_iters:
        out.append(
            f"--load {cfg.train.load} is at iteration {resume['iteration']}, not below --train-iters "
            f"{cfg.train.train_iters}: nothing to train; fix: raise --train-iters to continue"
        )
    saved, mine = resume["extra"].get("data"), data_signature(cfg)
    for key in (k for k in mine if saved is not None and k in saved and saved[k] != mine[k] and k != "tokenizer"):
        out.append(
            f"--load {cfg.train.load} was trained with {key} = {saved[key]}, this run has {mine[key]}: "
            f"the samples after the resume differ from those of an uninterrupted run"
        )
    return out


def prepare_run(cfg: Config, verify: bool = False) -> RunData:
    """Everything that can fail before any process group exists: the checkpoint to resume and
    the data. Returns the RunData, ``resume`` set to the checkpoint's meta (None without
    ``--load`` or a checkpoint); raises DataError, CheckpointError or RewardError (contract 3).
    ``verify`` re-reads the checkpoint's tensor files against their saved CRC-32 sums."""
    resume = checkpoint.peek(cfg.train.load, verify=verify) if cfg.train.load else None
    data = build_data(cfg, None if cfg.train.finetune else resume)  # --finetune: the data from its start
    check_resume(cfg, resume, data.vocab_size)
    if cfg.post.mode in ("grpo", "ppo"):  # the reward imports (or loads), every prompt leaves room for a response
        check_reward(cfg, data.vocab_size)
        check_prompt_room(cfg, data.train.prompts)
    if cfg.post.mode in ("dpo", "grpo", "ppo") and cfg.post.ref_load:  # the reference, before any process starts
        reference = checkpoint.peek(cfg.post.ref_load, verify=verify)
        if reference is None:
            raise checkpoint.CheckpointError(
                f"--ref-load {cfg.post.ref_load}: no checkpoint there (no 'latest' file); fix: give the --save "
                "directory of the reference run"
            )
        check_resume(cfg, reference, data.vocab_size, flag="--ref-load")
    if cfg.train.from_hf:
        check_from_hf(cfg, data.vocab_size)
    if cfg.train.eval_harness_tasks:
        check_harness(cfg)
    return data


def check_reward(cfg: Config, vocab_size: int) -> None:
    """--post-train grpo's ``--reward``: a function that imports (``parse_reward``), or with
    ``rm:DIR`` a reward model that runs under ``--tp`` with this run's ``vocab_size``-token
    tokenizer and ``--seq-length`` (``check_reward_model``). Raises RewardError or
    CheckpointError."""
    where = reward_model_dir(cfg.post.reward)
    if where is None:
        parse_reward(cfg.post.reward)
        return
    sha = tokenizer_digest(cfg.data.tokenizer_model)
    check_reward_model(where, cfg.parallel.tp, vocab_size, sha, cfg.model.seq_length)


def check_prompt_room(cfg: Config, prompts) -> None:
    """--post-train grpo: every prompt (a ``data.prompts.PromptSet``) leaves ``--max-new-tokens``
    in ``--seq-length``; raises DataError naming the longest prompt's file and line."""
    lengths = prompts.lengths()
    room = cfg.model.seq_length - cfg.post.max_new_tokens
    i = int(lengths.argmax())
    if lengths[i] > room:
        raise DataError(
            f"{prompts.where(i)}: a prompt of {lengths[i]} tokens leaves no room for --max-new-tokens "
            f"{cfg.post.max_new_tokens} in --seq-length {cfg.model.seq_length}; fix: --seq-length "
            f"{int(lengths[i]) + cfg.post.max_new_tokens}, or drop longer prompts (python -m data.prompts "
            f"--max-prompt-length {room})"
        )


def check_memory(cfg: Config, vocab_size: int, verbose: bool) -> memory.MemoryEstimate:
    """Print the memory plan (``verbose``) and raise MemoryPlanError when the model states
    cannot fit; a likely activation overflow is a warning, and so are a ZeRO-3 live bound the
    model's gather units make moot and, on CUDA, an attention that lands on SDPA's math kernel
    (both added to ``cfg.warnings``). Returns the plan."""
    device = "cuda" if uses_cuda(cfg) else "cpu"
    gpt = build_gpt_config(cfg, vocab_size)
    platform = CudaPlatform.current(torch.device("cuda")) if device == "cuda" else None
    plan = plan_memory(cfg, gpt, on_cuda=device == "cuda", platform=platform)
    available = memory.available_bytes_per_rank(device, memory.ranks_per_node())
    warning = memory.check_fits(plan, available)
    moot = zero3_live_warning(cfg, gpt)
    math = attention_math_warning(cfg, gpt, platform)
    cfg.warnings += [w for w in (moot, math) if w]
    if verbose:
        print(f"[megazero] {memory.describe(plan, available)}", flush=True)
        if warning:
            print(f"megazero: warning: {warning}", file=sys.stderr, flush=True)
        for w in (moot, math):
            if w:
                print(f"megazero: config warning: {w}", file=sys.stderr, flush=True)
    return plan


def uses_nvme(cfg: Config) -> bool:
    """Whether this run keeps swap files under ``--offload-nvme-path``."""
    return "nvme" in (cfg.zero.offload_optimizer, cfg.zero.offload_param) and bool(cfg.zero.offload_nvme_path)


def check_nvme(cfg: Config, plan: memory.MemoryEstimate, keep: bool = False, room: bool = True) -> None:
    """With NVMe offload: raise NvmePathError when ``--offload-nvme-path`` is not a directory,
    cannot be created, is not writable or (``room``) has less free space than this node's
    ranks' swap files take (``nvme_swap_bytes`` x ranks per node; call it after ``sweep_nvme``,
    so stale folders do not count as taken); ``keep``: leave a directory it created (the
    ranks, which all check at once), else remove it (``swap_dirs.check_nvme_path``)."""
    if uses_nvme(cfg):
        need = nvme_swap_bytes(cfg, plan) * memory.ranks_per_node() if room else 0
        check_nvme_path(cfg.zero.offload_nvme_path, need, keep=keep)


def sweep_nvme(cfg: Config) -> None:
    """Remove the swap folders under ``--offload-nvme-path`` whose process is gone (a killed
    rank of an earlier run or of the attempt torchrun restarted), one line each."""
    if uses_nvme(cfg):
        sweep_stale(cfg.zero.offload_nvme_path, log=lambda line: print(line, flush=True))


START_ERRORS = (
    DataError,
    checkpoint.CheckpointError,
    memory.MemoryPlanError,
    DeviceError,
    MissingExtra,
    HarnessError,
    NvmePathError,
    RewardError,
)


def report_start_error(e: Exception) -> int:
    """One line on stderr for a problem found before start; returns exit code 2."""
    kind = {
        DataError: "data",
        memory.MemoryPlanError: "memory",
        DeviceError: "device",
        MissingExtra: "config",
        HarnessError: "config",
        NvmePathError: "config",
        RewardError: "config",
    }.get(type(e), "checkpoint")
    print(f"megazero: {kind} error: {e}", file=sys.stderr)
    return 2


def preflight(argv: list[str], world_size: int, exports_file: Optional[str] = None) -> int:
    """Check the settings, the data and the checkpoint as ``main`` would, starting nothing.

    The launcher runs it once before torchrun, so a bad configuration ends with its one-line
    message and exit code 2 instead of torchrun's per-rank failure report; with NVMe offload it
    also sweeps the stale swap folders of runs that are gone (before the free-space check).
    Returns 0 or 2.
    ``exports_file``: where to write the launcher's ``export NAME=VALUE`` lines for this run
    (``launch_exports``: CUDA_DEVICE_MAX_CONNECTIONS where the overlap needs it), each after a
    comment with its reason; the launcher sources it before torchrun.
    """
    cfg = config_from_argv(argv, world_size)
    try:
        check_device(cfg, memory.ranks_per_node())
        data = prepare_run(cfg, verify=True)
        plan = check_memory(cfg, data.vocab_size, verbose=True)
        sweep_nvme(cfg)
        check_nvme(cfg, plan)
    except START_ERRORS as e:
        return report_start_error(e)
    for w in resume_warnings(cfg, data.resume):
        print(f"megazero: warning: {w}", file=sys.stderr, flush=True)
    if exports_file is not None:
        import shlex

        with open(exports_file, "w") as f:
            f.writelines(
                f"# {why}\nexport {name}={shlex.quote(value)}\n" for name, value, why in launch_exports(cfg, os.environ)
            )
    return 0
