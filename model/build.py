"""From megazero's Config to this rank's GPT: the GPTConfig, the model chunks of this pipeline
stage (built from full tensors and partitioned, DESIGN contract 1 in docs/design.md, one full
tensor at a time: model/materialize.py), their ZeRO-3 gather units, an optional Hugging Face
starting point, the memory the build needs (``build_peak_bytes``) and the model signature a
checkpoint must match. The Trainer (train.py), the planner and the scripts build the model here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Optional

import torch
from torch import nn

from megazero import collectives
from megazero.checkpoint import CheckpointError
from megazero.config import Config
from megazero.data_parallel.policy import sharding_policy
from megazero.param_spec import chunk_entries
from megazero.pipeline import partition
from megazero.precision import model_dtype
from megazero.process_groups import ProcessGroups
from model.config import GLU_FIELDS, MLA_FIELDS, ROPE_SCALING_FIELDS, GPTConfig
from model.gpt import GPTStage
from model.hf import HFConversionError
from model.hf_folder import check_folder, folder_model_type, open_folder
from model.spec import InitialWeights
from model.value_head import WithSeededHead


def build_gpt_config(cfg: Config, vocab_size: int) -> GPTConfig:
    """The GPTConfig of ``cfg``'s model settings with ``vocab_size`` real tokens; with ``--from-hf``
    a Mistral folder's family is kept for the export (``hf_model_type``, read from its config.json)."""
    m = cfg.model
    return GPTConfig(
        vocab_size=vocab_size,
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        ffn_hidden_size=m.ffn_hidden_size,
        seq_length=m.seq_length,
        max_position_embeddings=m.max_position_embeddings,
        hidden_dropout=m.hidden_dropout,
        attention_dropout=m.attention_dropout,
        tie_embeddings=not m.untie_embeddings_and_output_weights,
        layernorm_epsilon=m.layernorm_epsilon,
        init_method_std=m.init_method_std,
        make_vocab_size_divisible_by=m.make_vocab_size_divisible_by,
        sequence_parallel=cfg.parallel.sequence_parallel and cfg.parallel.tp > 1,
        # torch.compile cannot trace the overlapped backward (a hand-written autograd.Function);
        # zero-bubble schedules split the backward into B and W, and that Function computes
        # both at once (megazero/pipeline/weight_grad.py): B's all-reduce then runs unoverlapped
        tp_overlap_grad_reduce=(
            cfg.parallel.async_tensor_model_parallel_allreduce
            and not cfg.train.compile
            and cfg.parallel.pipeline_schedule not in ("zb-h1", "zb-v")
        ),
        params_dtype=model_dtype(cfg.precision.fp16, cfg.precision.bf16),
        fp8_format=cfg.precision.fp8_format,
        fp8_recipe=cfg.precision.fp8_recipe,
        fp8_block=cfg.precision.fp8_block,
        label_smoothing=m.label_smoothing,
        value_head=cfg.post.mode == "rm",
        norm_backend=cfg.optim.kernels,
        position_embedding_type=m.position_embedding_type,
        rotary_base=m.rotary_base,
        rotary_percent=m.rotary_percent,
        **{name: getattr(m, name) for name in ROPE_SCALING_FIELDS},
        normalization=m.normalization,
        swiglu=m.swiglu,
        **{name: getattr(m, name) for name in GLU_FIELDS},
        openai_gelu=m.openai_gelu,
        num_query_groups=m.num_query_groups if m.group_query_attention else None,
        add_bias_linear=m.add_bias_linear,
        add_qkv_bias=m.add_qkv_bias,
        kv_channels=m.kv_channels,
        qk_layernorm=m.qk_layernorm,
        softmax_type=m.softmax_type,
        **{name: getattr(m, name) for name in MLA_FIELDS},
        window_size=m.window_size,
        window_attn_skip_freq=m.window_attn_skip_freq,
        hf_model_type=folder_model_type(cfg.train.from_hf) if cfg.train.from_hf else None,
        cp_comm_type=cfg.parallel.cp_comm_type,
        cp_ring_kernel=cfg.parallel.cp_ring_kernel,
        recompute_granularity=m.recompute_granularity,
        recompute_method=m.recompute_method,
        recompute_num_layers=m.recompute_num_layers,
        mtp_num_layers=m.mtp_num_layers,
        mtp_loss_scaling_factor=m.mtp_loss_scaling_factor,
        **({} if m.num_experts is None else {name: getattr(m, name) for name in MOE_FIELDS}),
    )


# the MoE settings GPTConfig shares with ModelConfig (same names)
MOE_FIELDS = (
    "num_experts",
    "moe_ffn_hidden_size",
    "moe_router_topk",
    "moe_layer_freq",
    "moe_shared_expert_intermediate_size",
    "moe_router_score_function",
    "moe_router_dtype",
    "moe_router_num_groups",
    "moe_router_group_topk",
    "moe_router_topk_scaling_factor",
    "moe_router_pre_softmax",
    "moe_router_load_balancing_type",
    "moe_aux_loss_coeff",
    "moe_z_loss_coeff",
    "moe_expert_capacity_factor",
    "moe_token_drop_policy",
    "moe_pad_expert_input_to_capacity",
    "moe_router_linear_bias",
    "moe_router_enable_expert_bias",
    "moe_router_bias_update_rate",
    "moe_token_dispatcher_type",
)


def build_model_chunks(
    gcfg: GPTConfig, cfg: Config, groups: ProcessGroups, device: torch.device, materialize: Optional[bool] = None
) -> list[GPTStage]:
    """This rank's model chunks (one, or V for the interleaved schedule), in the model dtype.

    Every chunk starts from the full tensors of (seed, parameter name) and keeps its
    partition, so any layout starts from the same model (docs/design.md, contract 1); the full
    tensors are made one at a time (``GPTStage.materialize``). At ZeRO-3 the chunks come back
    unmaterialized (``materialized`` False: placeholders holding no memory) and
    ``DataParallel(initial_values=initial_values(chunks))`` writes each parameter straight into
    its gather unit's shard, so no rank ever holds its whole partition. With ``--tf32`` on
    CUDA, fp32 matmuls run on TF32 (``set_tf32``). ``materialize`` (default: unless ZeRO-3)
    overrides that choice, e.g. False for chunks filled later from a checkpoint's partitions.
    """
    p = cfg.parallel
    set_tf32(cfg.precision.tf32, device)
    chunks, tracker = [], None
    full = from_hf_weights(cfg, gcfg, groups.tp_size)
    layout = partition.chunk_layout(p.pipeline_schedule)
    for v in range(p.virtual_pipeline_size):
        ids = partition.layer_ids(
            gcfg.num_layers, p.pp, groups.pp_rank, p.virtual_pipeline_size, v, p.pipeline_layer_split, layout
        )
        chunk = GPTStage(
            gcfg,
            groups,
            ids,
            pre_process=partition.is_pre_process(groups.pp_rank, v),
            post_process=partition.is_post_process(groups.pp_rank, p.pp, v, p.virtual_pipeline_size, layout),
            seed=cfg.train.seed,
            rng_tracker=tracker,
            device=device,
            full_weights=full,
            materialize=not sharding_policy(cfg.zero.stage).shards_params if materialize is None else materialize,
        )
        tracker = chunk.rng_tracker  # one dropout stream for all chunks of this stage
        chunks.append(chunk)
    if cfg.train.compile:
        compile_layers(chunks)
    return chunks


def initial_values(chunks: list[GPTStage]) -> list[Optional[Callable[[str], torch.Tensor]]]:
    """Per chunk, what ``DataParallel(initial_values=...)`` fills an unmaterialized chunk from
    (its ``initial_partition``), or None for a chunk whose parameters hold their values."""
    return [None if c.materialized else c.initial_partition for c in chunks]


def set_tf32(enabled: bool, device: torch.device) -> None:
    """``--tf32`` on CUDA: let fp32 matmuls (cuBLAS) and convolutions (cuDNN) run on TF32 tensor
    cores (inputs rounded to a 10-bit mantissa, fp32 accumulation; NVIDIA's A100 white paper,
    "TF32"). Through ``fp32_precision = "tf32"`` where torch has it (2.9+; the ``allow_tf32``
    switches are to be deprecated), else ``allow_tf32``. Without the flag, or on another
    device, nothing is touched: PyTorch's default (no TF32 in matmuls) stays."""
    if not enabled or device.type != "cuda":
        return
    if hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        torch.backends.cuda.matmul.fp32_precision = "tf32"
        torch.backends.cudnn.conv.fp32_precision = "tf32"
    else:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def compile_layers(chunks: list[GPTStage]) -> None:
    """--compile: ``torch.compile`` each transformer layer in place (``nn.Module.compile``:
    parameter names, hooks and checkpoints unchanged); embeddings, head, the pipeline and
    ZeRO machinery stay eager; the collectives' bookkeeping runs eagerly between the traced
    graphs (``collectives.keep_bookkeeping_out_of_compiled_graphs``)."""
    collectives.keep_bookkeeping_out_of_compiled_graphs()
    for chunk in chunks:
        for layer in chunk.layers.values():
            layer.compile()


def from_hf_weights(cfg: Config, gcfg: GPTConfig, tp_size: int):
    """With ``--from-hf DIR``: the canonical full tensors of DIR's GPT-2, Llama, Mixtral or
    Qwen2-MoE model, read lazily (each stage loads only its own), vocabulary re-padded for
    ``tp_size``; else None.
    A reward model (``gcfg.value_head``) reads the language model there and starts its value head
    from the seed (``model.value_head.WithSeededHead``).
    Raises HFConversionError (model.hf_folder.open_folder) for a folder that does not hold it."""
    if cfg.train.from_hf is None:
        return None
    lm = open_folder(cfg.train.from_hf, replace(gcfg, value_head=False), gcfg.padded_vocab(tp_size))
    return WithSeededHead(lm, InitialWeights(gcfg, cfg.train.seed, tp_size)) if gcfg.value_head else lm


def check_from_hf(cfg: Config, vocab_size: int) -> None:
    """Before any process group: --from-hf's folder holds this run's model, its config.json and
    every tensor's shape and dtype (``model.hf_folder.check_folder``, headers only). Raises
    CheckpointError naming the file and the fix when it does not or a file cannot be read;
    MissingExtra (megazero.runtime.extras) without the ``hf`` extra."""
    try:
        check_folder(cfg.train.from_hf, replace(build_gpt_config(cfg, vocab_size), value_head=False))
    except HFConversionError as e:
        raise CheckpointError(f"--from-hf {e}") from None


def zero3_units(chunk: GPTStage) -> list[nn.Module]:
    """ZeRO-3 gather units of one model chunk in forward order: the embedding (its position
    table alone when the word embedding is also the tied output layer or read by multi-token
    prediction on the last stage, which then stays in the chunk's own unit, gathered around the
    whole chunk), each block, the final norm, an untied output layer and the MTP modules."""
    units, tied = [], chunk.cfg.tie_embeddings or chunk.cfg.mtp_num_layers > 0
    if chunk.pre_process:
        emb = chunk.embedding
        units += [emb] if not tied else ([emb.position_embeddings] if emb.with_positions else [])
    units += list(chunk.layers.values())
    if chunk.post_process:
        units += [chunk.final_ln] + ([] if chunk.cfg.tie_embeddings else [chunk.output])
        units += list(chunk.mtp) if chunk.cfg.mtp_num_layers > 0 else []  # one unit per depth
    return units


@dataclass(frozen=True)
class BuildPeak:
    """Predicted memory of building one rank's model chunks (model/materialize.py), in bytes.

    ``resident``: the parameters the rank keeps: its TP partitions in the model dtype, at ZeRO-3
    their 1/N shards (N = dp x cp; parameters under ``--zero3-param-persistence-threshold``
    whole; the buckets' padding, under N elements each, not counted). ZeRO's gradients and
    optimizer state are not build memory (``megazero.planning.memory`` counts them).
    ``full``: the largest full fp32 tensor of the rank's chunks. ``in_flight``: the most held
    at once beside ``resident`` while one parameter is made: its full fp32 tensor, the fp32
    partition cut from it and that partition's copy in the model dtype on the device, where it
    is another tensor. ``peak`` puts it all in one memory, as on the CPU; on CUDA the full
    tensor and its fp32 partition are host memory, ``resident`` and the copy device memory.
    ``bound``: 2 x (full + resident), what tests/layouts/test_model_build.py holds the measured peak to.
    Reading ``--from-hf`` adds the file's own dtype and layout conversions to ``in_flight``.
    """

    resident: int
    full: int
    in_flight: int

    @property
    def peak(self) -> int:
        return self.resident + self.in_flight

    @property
    def bound(self) -> int:
        return 2 * (self.full + self.resident)


def build_peak_bytes(cfg: Config, gcfg: GPTConfig, pp_rank: int = 0, device_type: str = "cpu") -> BuildPeak:
    """What building pipeline stage ``pp_rank``'s chunks (``build_model_chunks``, then
    ``DataParallel`` at ZeRO-3) holds at most on one of its ranks, from the parameter spec
    alone (no tensor is made): a ``BuildPeak``. ``device_type``: where the parameters live
    ("cpu" or "cuda"; on CUDA the model-dtype copy of every partition is a tensor of its own)."""
    p, tp = cfg.parallel, cfg.parallel.tp
    etp = p.expert_tensor_parallel_size or tp  # a routed expert's partitions: 1/etp
    item = gcfg.params_dtype.itemsize
    shards = p.dp * p.cp if sharding_policy(cfg.zero.stage).shards_params else 1
    threshold = cfg.zero.zero3_param_persistence_threshold
    spec = gcfg.parameter_spec(tp)
    resident = full = in_flight = 0
    for v in range(p.virtual_pipeline_size):
        ids = partition.layer_ids(gcfg.num_layers, p.pp, pp_rank, p.virtual_pipeline_size, v, p.pipeline_layer_split)
        pre = partition.is_pre_process(pp_rank, v)
        post = partition.is_post_process(pp_rank, p.pp, v, p.virtual_pipeline_size)
        for e in chunk_entries(spec, ids, pre, post):
            local = e.local_numel(etp if ".mlp.experts." in e.name else tp)
            resident += item * (local if shards == 1 or local < threshold else -(-local // shards))
            cut = 4 * local if e.partition_dim is not None else 0  # replicated: the full tensor is it
            copied = e.partition_dim is None or item != 4 or device_type != "cpu"
            in_flight = max(in_flight, 4 * e.numel + cut + (item * local if copied else 0))
            full = max(full, 4 * e.numel)
    return BuildPeak(resident, full, in_flight)


def _changed(g: GPTConfig, name: str) -> bool:
    return getattr(g, name) != GPTConfig.__dataclass_fields__[name].default


def model_signature(g: GPTConfig) -> dict:
    """The sizes a checkpoint must share with the model that loads it (layout excluded); an MoE
    model adds its expert sizes (a dense model's signature is unchanged)."""
    moe = (
        {}
        if g.num_experts is None
        else dict(
            num_experts=g.num_experts,
            moe_ffn_hidden_size=g.moe_ffn_hidden_size,
            moe_layer_freq=g.moe_layer_freq,
            moe_shared_expert_intermediate_size=g.moe_shared_expert_intermediate_size,
        )
    )
    # RoPE scaling, the QKV-only bias, --kv-channels, QK-norm, the softmax type and the gated unit's
    # variants and MLA's sizes enter only when changed, so older checkpoints keep their signature
    fields = ROPE_SCALING_FIELDS + ("add_qkv_bias", "kv_channels", "qk_layernorm", "softmax_type") + GLU_FIELDS
    fields += MLA_FIELDS + ("mtp_num_layers",)
    optional = moe | {name: getattr(g, name) for name in fields if _changed(g, name)}
    return optional | dict(
        vocab_size=g.vocab_size,
        num_layers=g.num_layers,
        hidden_size=g.hidden_size,
        num_attention_heads=g.num_attention_heads,
        ffn_hidden_size=g.ffn_hidden_size,
        max_position_embeddings=g.max_position_embeddings,
        tie_embeddings=g.tie_embeddings,
        position_embedding_type=g.position_embedding_type,
        rotary_base=g.rotary_base,
        rotary_percent=g.rotary_percent,
        normalization=g.normalization,
        swiglu=g.swiglu,
        num_query_groups=g.num_query_groups,
        add_bias_linear=g.add_bias_linear,
        openai_gelu=g.openai_gelu,
    )
