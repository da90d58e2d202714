"""A whole model for inference, as ``python -m scripts.generate`` and ``python -m scripts.evaluate``
load it: every process one tensor-parallel rank (pipeline and data-parallel size 1) holding
only its own partitions of the full weights.

The weights come from a megazero checkpoint of any layout (``--load``:
``megazero.checkpoint.read_partitions``: each rank reads only its own partitions, so it holds
them plus one saved chunk at a time, never every full tensor) or a Hugging Face GPT-2 / Llama /
Mixtral / Qwen2-MoE folder (``--from-hf``: ``model.hf_folder``); the tokenizer is the
checkpoint's recorded one, the folder's ``tokenizer.json``, or ``--tokenizer-model``.
``check_model`` checks every input (settings and sizes under tp, each tensor's shape and dtype
or the checkpoint's files, the tokenizer) without loading a weight or creating a process group,
so a bad input ends with one line before torchrun starts; ``load_model`` then loads.

The functions take the tools' parsed command line as ``source``: any object with the attributes
``load``, ``from_hf`` (one of them None), ``tokenizer_model`` and ``tokenizer_type`` (None for
the recorded ones).
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from data.indexed_dataset import DataError
from megazero.checkpoint import CheckpointError, peek, read_partitions
from megazero.process_groups import ProcessGroups
from megazero.runtime.extras import MissingExtra
from megazero.topology import Topology
from model.config import GPTConfig
from model.gpt import VOCAB_TENSORS, GPTStage
from model.hf import HFConversionError, config_from_record
from model.hf_folder import folder_config, open_folder
from model.moe_state import load_expert_bias

# what a bad input raises (ConfigError and the sampling settings' errors are ValueErrors)
INPUT_ERRORS = (CheckpointError, HFConversionError, DataError, MissingExtra, ValueError, OSError)


def model_settings(source, **settings) -> tuple[GPTConfig, str | None, str]:
    """(the model's GPTConfig with dropout off and ``settings`` (GPTConfig fields) applied,
    tokenizer path or None, tokenizer type), read without loading a weight: --from-hf's
    config.json, or the meta.pt of the latest checkpoint under --load (``peek`` also checks
    its files' sizes). Raises HFConversionError or CheckpointError naming the file."""
    off = dict(hidden_dropout=0.0, attention_dropout=0.0, **settings)
    if source.from_hf:
        gcfg = folder_config(source.from_hf, **off)
        return gcfg, source.tokenizer_model or source.from_hf, source.tokenizer_type or "HuggingFaceTokenizer"
    meta = peek(source.load)
    if meta is None:
        raise CheckpointError(
            f"--load {source.load}: no checkpoint there (no 'latest' file); fix: give the --save directory of a run"
        )
    if "gpt_config" not in meta["extra"]:
        raise CheckpointError(
            f"--load {source.load}: the checkpoint does not record its model settings (saved by an older megazero)"
        )
    recorded = meta["extra"].get("tokenizer") or {}
    return (
        config_from_record(meta["extra"]["gpt_config"], **off),
        source.tokenizer_model or recorded.get("model"),
        source.tokenizer_type or recorded.get("type", "SentencePieceTokenizer"),
    )


def has_tokenizer(path) -> bool:
    """Whether ``path`` (a tokenizer file, or a Hugging Face folder) holds a tokenizer to load."""
    if path is None:
        return False
    return os.path.isfile(os.path.join(path, "tokenizer.json")) if os.path.isdir(path) else os.path.exists(path)


def check_model(source, tp: int, need_tokenizer: bool = True):
    """The model's settings and their sizes under ``tp`` ranks (``GPTConfig.validate``), every
    tensor's name, shape and dtype (--from-hf, ``model.hf_folder.open_folder``) or the
    checkpoint's files (--load), and the tokenizer (its vocabulary within the model's), without
    loading a weight. Returns the tokenizer, or None when there is none and ``need_tokenizer``
    is False. Raises one of ``INPUT_ERRORS``, whose message is the one line to print."""
    from data.tokenizer import load_tokenizer

    gcfg, tok_path, tok_type = model_settings(source)
    where = os.path.join(source.from_hf, "config.json") if source.from_hf else f"--load {source.load}"
    try:
        gcfg.validate(tp)
    except ValueError as e:  # ConfigError, naming the setting
        raise ValueError(f"{where}: the model does not run under --tp {tp}: {e}") from None
    if source.from_hf:
        open_folder(source.from_hf, gcfg, gcfg.padded_vocab(tp))  # checks every tensor, loads none
    if not need_tokenizer and not has_tokenizer(tok_path):
        return None
    if tok_path is None:
        raise CheckpointError(
            "no tokenizer: the run used --mock-data; fix: give --tokenizer-model, or the prompt as --prompt-ids"
        )
    tok = load_tokenizer(tok_path, tok_type)
    if tok.vocab_size > gcfg.vocab_size:  # its ids past the embedding's rows would not index it
        raise DataError(
            f"tokenizer {tok_path} has {tok.vocab_size} tokens, more than the model's vocabulary of "
            f"{gcfg.vocab_size}; fix: --tokenizer-model of this model"
        )
    return tok


def load_model(
    source, groups: ProcessGroups, device, need_tokenizer: bool = True, **settings
) -> tuple[GPTStage, object]:
    """(whole-model stage with this rank's TP partitions of ``groups``, tokenizer or None) on
    ``device``. Without ``need_tokenizer`` a source without a tokenizer gives None for it;
    ``settings``: GPTConfig fields to override (``model_settings``). Raises one of
    ``INPUT_ERRORS``."""
    from data.tokenizer import load_tokenizer

    gcfg, tok_path, tok_type = model_settings(source, **settings)
    if not need_tokenizer and not has_tokenizer(tok_path):
        tok_path = None
    tok = load_tokenizer(tok_path, tok_type) if tok_path else None
    if source.from_hf:
        full = open_folder(source.from_hf, gcfg, gcfg.padded_vocab(groups.tp_size))
        return GPTStage(gcfg, groups, range(gcfg.num_layers), True, True, seed=0, full_weights=full, device=device), tok
    stage = GPTStage(gcfg, groups, range(gcfg.num_layers), True, True, seed=0, device=device, materialize=False)
    meta, parts = read_partitions(
        source.load,
        dict(stage.named_parameters()),
        groups.tp_rank,
        groups.tp_size,
        real_rows=lambda name: gcfg.vocab_size if name in VOCAB_TENSORS else None,
    )
    stage.materialize(parts)
    load_expert_bias([stage], meta["extra"].get("moe_expert_bias", {}))  # the router's choice bias, not a parameter
    return stage, tok


def start_torchrun(tp: int, module: str, argv: list[str]) -> None:
    """Replace this process by torchrun running ``python -m module argv`` on ``tp`` ranks of this
    machine (after the input check passed here), in the current directory; its exit status
    becomes this command's. The ranks share the cores (``OMP_NUM_THREADS``, unless set)."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // tp)))
    sys.stdout.flush()
    os.execve(
        sys.executable,
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(tp),
            "-m",
            module,
            *argv,
        ],
        env,
    )


def join_tp_ranks(device_type: str, world: int, timeout_s: float) -> tuple[torch.device, ProcessGroups]:
    """This process as one of ``world`` tensor-parallel ranks (pipeline and data-parallel size
    1): its device (``cuda:LOCAL_RANK``, made current before the process group or any tensor
    opens a context on GPU 0, or the CPU), the process group (NCCL on CUDA, else gloo, with
    ``timeout_s`` seconds for a collective) and the groups."""
    on_cuda = device_type == "cuda"
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if on_cuda else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            timeout=timedelta(seconds=timeout_s),
            device_id=device if device.type == "cuda" else None,
        )
    return device, ProcessGroups.build(Topology(tp=world, pp=1, dp=1))


def check_reward_model(load: str, tp: int, vocab_size: int, tokenizer_sha256: Optional[str], seq_length: int) -> None:
    """``--reward rm:DIR`` before any rank starts: the latest checkpoint under ``load`` is a
    reward model (``--post-train rm``: a value head) that runs under ``tp`` ranks, with the
    run's vocabulary (``vocab_size`` tokens, and the tokenizer whose sha256 is
    ``tokenizer_sha256`` where both sides record one) and room for ``seq_length`` positions.
    Loads no weight. Raises CheckpointError, one line naming ``--reward rm:DIR`` and the fix."""
    where = f"--reward rm:{load}"
    gcfg = reward_model_config(load)
    try:
        gcfg.validate(tp)
    except ValueError as e:
        raise CheckpointError(f"{where}: the reward model does not run under --tp {tp}: {e}") from None
    if gcfg.vocab_size != vocab_size:
        raise CheckpointError(
            f"{where}: the reward model has a vocabulary of {gcfg.vocab_size} tokens, this run's tokenizer "
            f"{vocab_size}; fix: a reward model trained with this run's --tokenizer-model"
        )
    meta = peek(load)
    recorded = ((meta or {}).get("extra", {}).get("tokenizer") or {}).get("sha256")
    if recorded and tokenizer_sha256 and recorded != tokenizer_sha256:
        raise CheckpointError(
            f"{where}: the reward model was trained with another tokenizer (sha256 {recorded[:12]}) than this "
            f"run's (sha256 {tokenizer_sha256[:12]}); fix: a reward model trained with this run's --tokenizer-model"
        )
    room = gcfg.max_position_embeddings or gcfg.seq_length
    if gcfg.position_embedding_type == "learned_absolute" and room < seq_length:
        raise CheckpointError(
            f"{where}: the reward model has {room} positions, fewer than --seq-length {seq_length}; "
            f"fix: --seq-length {room}, or a reward model trained with --seq-length {seq_length}"
        )


def reward_model_config(load: str) -> GPTConfig:
    """The GPTConfig of the reward model under ``load`` as ``load_reward_model`` builds it
    (dropout and sequence parallelism off). Raises CheckpointError naming ``--reward rm:DIR``
    for a missing checkpoint or one without a value head."""
    from types import SimpleNamespace

    source = SimpleNamespace(load=load, from_hf=None, tokenizer_model=None, tokenizer_type=None)
    if peek(load) is None:
        raise CheckpointError(
            f"--reward rm:{load}: no checkpoint there (no 'latest' file); fix: the --save directory of a "
            "--post-train rm run"
        )
    try:
        gcfg, _, _ = model_settings(source, sequence_parallel=False)
    except CheckpointError as e:
        raise CheckpointError(f"--reward rm:{load}: {e}") from None
    if not gcfg.value_head:
        raise CheckpointError(
            f"--reward rm:{load}: the checkpoint is a language model, not a reward model (no value head); "
            "fix: the --save directory of a --post-train rm run"
        )
    return gcfg


def load_reward_model(load: str, groups: ProcessGroups, device) -> GPTStage:
    """A ``--post-train rm`` checkpoint under ``load`` as a whole-model stage in eval mode (this
    rank's tp partitions of ``groups``, the value head included; sequence parallelism off, so
    any sequence length runs), for ``--reward rm:DIR`` scores
    (``megazero.post_training.rewards.reward_model_scores``). ``groups``: a layout with pipeline
    and context parallel size 1 (``ProcessGroups.tensor_parallel_only``). Raises CheckpointError
    naming ``--reward rm:DIR`` for a missing checkpoint or one without a value head (a language
    model)."""
    from types import SimpleNamespace

    reward_model_config(load)
    source = SimpleNamespace(load=load, from_hf=None, tokenizer_model=None, tokenizer_type=None)
    stage, _ = load_model(source, groups, device, need_tokenizer=False, sequence_parallel=False)
    return stage.eval()
