"""DeepSpeed ZeRO-0/1/2 and Megatron-core tensor parallelism for ``scripts/bench/bench_peers.py``.

Benchmark-only optional peers: nothing in ``megazero/``, ``model/`` or the tests imports this
file, and each runner imports its package inside itself, so ``bench_peers.py`` skips a peer
that is not installed (``peer_available``). Install them in a separate environment
(docs/performance.md, "megazero against its peers"); on a CPU machine DeepSpeed runs with
``DS_ACCELERATOR=cpu`` over the already-initialised gloo process group.

- ``deepspeed_system``: ``deepspeed.initialize`` around the same ``GPTStage`` with a
  ``torch.optim.AdamW`` client optimizer, ZeRO stage 0/1/2, ``gradient_clipping`` and
  ``gradient_accumulation_steps`` from the benchmark (DeepSpeed divides each micro-batch loss
  by the accumulation steps itself and reduces gradients only at the boundary).
- ``megatron_core_system``: Megatron-core's ``GPTModel`` with its local (non-Transformer-Engine)
  layer spec at tp = world size, loaded with megazero's initial weights (``megatron_core_weights``:
  the same numbers in Megatron's layout), trained with AdamW and Megatron's gradient clipping
  (the global L2 norm over the TP group counting replicated parameters once, as
  ``megatron.core.optimizer.clip_grads``; re-implemented because that module allocates its
  scalars on CUDA).

Megatron-core on CPU needs three shims, none touching the math: the global memory buffer that
``DotProductAttention`` uses as ``baddbmm``'s (beta = 0) input is allocated on CPU instead of
``torch.cuda.current_device()``; the RNG tracker is Megatron's inference tracker (a no-op
fork, dropout is 0 here); the causal mask is passed in (its default builder allocates on CUDA).
"""

from __future__ import annotations

import importlib.util
import os

PEER_PACKAGES = {"deepspeed": "deepspeed", "megatron-core": "megatron.core"}


def adamw_groups(params, weight_decay: float) -> list[dict]:
    """megazero's parameter groups for a peer's ``torch.optim.AdamW``: weight decay on the
    matrices (``ndim >= 2``: linear weights, embeddings), none on biases and norm weights, the
    rule of ``megazero.tags.decays`` for this model and Megatron-LM's. Without
    it a peer's ``AdamW(model.parameters())`` decays everything and trains another model."""
    params = list(params)
    return [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]


def peer_available(peer: str) -> bool:
    """Whether ``peer`` ("deepspeed" or "megatron-core") can be imported here."""
    name = PEER_PACKAGES[peer]
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # the parent package ("megatron") is absent
        return False


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one buffer count once)."""
    seen = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def _tensors_in(obj, depth: int = 2):
    """Every tensor (and its ``.grad``) reachable from ``obj`` through dicts, lists and
    tuples, ``depth`` levels deep."""
    import torch

    if isinstance(obj, torch.Tensor):
        yield obj
        if obj.grad is not None:
            yield obj.grad
    elif depth > 0 and isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors_in(v, depth - 1)
    elif depth > 0 and isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors_in(v, depth - 1)


#: DeepSpeed ZeRO-1/2 optimizer attributes holding model state: the flat parameter groups,
#: the fp32 partitions, the reduced gradient partitions and the reduction buckets.
DEEPSPEED_STATE_ATTRS = (
    "bit16_groups_flat",
    "single_partition_of_fp32_groups",
    "averaged_gradients",
    "ipg_buffer",
    "grads_in_partition",
)


def deepspeed_state_bytes(engine, ds_opt) -> int:
    """Bytes of the distinct storages of DeepSpeed's model state on this rank: the module's
    parameters and gradients, the wrapped torch optimizer's parameters, gradients and Adam
    moments, and the ZeRO optimizer's ``DEEPSPEED_STATE_ATTRS``."""
    inner = getattr(ds_opt, "optimizer", ds_opt)
    tensors = list(_tensors_in(list(engine.module.parameters()), 1))
    tensors += _tensors_in([p for g in inner.param_groups for p in g["params"]], 1)
    tensors += _tensors_in(list(inner.state.values()), 2)
    for name in DEEPSPEED_STATE_ATTRS:
        tensors += _tensors_in(getattr(ds_opt, name, None), 3)
    return storage_bytes([t for t in tensors if t.numel() > 1])


def deepspeed_system(args, model, stage: int, adamw: dict, clip: float, bucket: int):
    """(step, state) of DeepSpeed ZeRO ``stage`` training ``model`` (dp = world size).

    ``step(micro)`` runs ``len(micro)`` micro-batches ``(tokens, labels)`` ``[micro, seq]`` and
    one optimizer step, returning the summed mean loss / len(micro); ``state()``
    ``deepspeed_state_bytes``. ``bucket``: ``reduce_bucket_size`` and ``allgather_bucket_size``
    (elements), the benchmark's bucket for every system.
    """
    import torch

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world))
    import deepspeed

    config = {
        "train_micro_batch_size_per_gpu": args.micro,
        "gradient_accumulation_steps": args.accum,
        "gradient_clipping": clip,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": bucket, "allgather_bucket_size": bucket},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**30,
    }
    opt = torch.optim.AdamW(adamw_groups(model.parameters(), adamw["weight_decay"]), **adamw)
    engine, ds_opt, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config, dist_init_required=False)

    def step(micro):
        total = 0.0
        for t, l in micro:
            loss = engine(t, l).mean()
            engine.backward(loss)
            engine.step()
            total += loss.item() / len(micro)
        return total

    return step, lambda: deepspeed_state_bytes(engine, ds_opt)


def megatron_core_weights(full: dict, cfg) -> dict:
    """megazero's full (unpartitioned) GPT-2 tensors renamed and laid out as Megatron-core's
    ``GPTModel`` (local spec) holds them before its TP partitioning.

    ``attn.qkv`` ``[q; k; v]`` rows ``[3H, H]`` become Megatron's per-head ``[q_h; k_h; v_h]``
    blocks (``(3, heads, d, H) -> (heads, 3, d, H)``); biases alike. Multi-head attention with
    LayerNorm and biases only (the benchmark's GPT). Raises KeyError for another layout.
    """
    heads, d = cfg.num_attention_heads, cfg.head_dim
    out = {
        "embedding.word_embeddings.weight": full["embedding.word_embeddings.weight"],
        "embedding.position_embeddings.weight": full["embedding.position_embeddings.weight"],
        "decoder.final_layernorm.weight": full["final_ln.weight"],
        "decoder.final_layernorm.bias": full["final_ln.bias"],
    }
    names = {
        "ln1": "input_layernorm",
        "attn.proj": "self_attention.linear_proj",
        "attn.qkv": "self_attention.linear_qkv",
        "ln2": "pre_mlp_layernorm",
        "mlp.fc1": "mlp.linear_fc1",
        "mlp.fc2": "mlp.linear_fc2",
    }
    for i in range(cfg.num_layers):
        for ours, theirs in names.items():
            for kind in ("weight", "bias"):
                t = full[f"layers.{i}.{ours}.{kind}"]
                if ours == "attn.qkv":  # (3 heads d [H]) -> (heads 3 d [H])
                    t = t.reshape(3, heads, d, *t.shape[1:]).transpose(0, 1).reshape(t.shape)
                out[f"decoder.layers.{i}.{theirs}.{kind}"] = t
    return out


def _megatron_core_cpu_shims(torch, ps, tensor_parallel) -> None:
    """The CPU shims of the module docstring (memory buffer on CPU, no-op RNG fork)."""
    from megatron.core.utils import GlobalMemoryBuffer

    class CPUBuffer(GlobalMemoryBuffer):
        def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
            return torch.empty(tensor_shape, dtype=dtype)

    ps._GLOBAL_MEMORY_BUFFER = CPUBuffer()
    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True)


def _load_partitions(model, weights: dict, tp: int, rank: int) -> None:
    """Copy this TP rank's partition of each full tensor into ``model``'s parameter of that
    name; a parameter smaller than its full tensor along a dim is that dim's ``rank``-th of
    ``tp`` chunks (without ``perform_initialization`` Megatron sets no partition attributes).
    Marks each parameter ``bench_partitioned``."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            t = weights[name]
            partitioned = [d for d in range(t.dim()) if p.shape[d] != t.shape[d]]
            for d in partitioned:
                t = t.chunk(tp, dim=d)[rank]
            p.copy_(t)
            p.bench_partitioned = bool(partitioned)


def megatron_core_system(args, cfg, full: dict, adamw: dict, clip: float):
    """(step, state) of Megatron-core's GPTModel at tp = world size, from megazero's ``cfg``
    (``model.config.GPTConfig``, GPT-2 layout, tied embeddings) and full initial weights.

    Both TP ranks train on the same micro-batches; ``step`` returns the summed mean loss /
    len(micro), ``state()`` this rank's parameter, gradient and Adam bytes.
    """
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    tp = dist.get_world_size()
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tensor_model_parallel_size=tp)
        _megatron_core_cpu_shims(torch, ps, tensor_parallel)
    mc = TransformerConfig(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        ffn_hidden_size=cfg.ffn_hidden_size,
        layernorm_epsilon=cfg.layernorm_epsilon,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        use_cpu_initialization=True,
        perform_initialization=False,
        params_dtype=torch.float32,
    )
    model = GPTModel(
        mc,
        get_gpt_layer_local_spec(),
        vocab_size=cfg.padded_vocab(tp),
        max_sequence_length=cfg.seq_length,
        position_embedding_type="learned_absolute",
        share_embeddings_and_output_weights=True,
    )
    rank = ps.get_tensor_model_parallel_rank()
    _load_partitions(model, megatron_core_weights(full, cfg), tp, rank)
    params = list(model.parameters())
    counted = [p for p in params if p.bench_partitioned or rank == 0]
    opt = torch.optim.AdamW(adamw_groups(params, adamw["weight_decay"]), **adamw)
    group = ps.get_tensor_model_parallel_group()
    mask = torch.triu(torch.ones(cfg.seq_length, cfg.seq_length, dtype=torch.bool), 1)[None, None]
    position_ids = torch.arange(cfg.seq_length)[None]

    def step(micro):
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for t, l in micro:
            loss = model(t, position_ids.expand_as(t), mask, labels=l).mean() / len(micro)
            loss.backward()
            total += loss.item()
        sq = torch.stack([p.grad.square().sum() for p in counted]).sum()
        dist.all_reduce(sq, group=group)  # Megatron's get_grad_norm_fp32 (L2)
        coef = clip / (sq.sqrt().item() + 1e-6)
        if coef < 1.0:
            torch._foreach_mul_([p.grad for p in params], coef)
        opt.step()
        return total

    def state():
        tensors = params + [p.grad for p in params if p.grad is not None]
        tensors += [v for s in opt.state.values() for v in s.values() if v.numel() > 1]
        return storage_bytes(tensors)

    return step, state
