"""The MoE state a checkpoint keeps beside the parameters: each MoE layer's aux-loss-free expert
bias (DeepSeek-V3 section 2.1.2; ``model.gpt.MoEMLP.expert_bias``), a buffer updated from the
step's global token counts, not by the optimizer, so not in the optimizer's shards.

Every rank that holds a layer holds the same bias (the update uses counts summed over the dp
ranks), so the checkpoint stores it once, by global layer id, in ``meta.pt``'s extras; it is
independent of the layout (tp, pp, dp, expert parallelism) and loads under any other.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from megazero import collectives as C
from megazero.process_groups import ProcessGroups
from model.config import GPTConfig
from model.gpt import MoEMLP


def _biased_layers(chunks: Iterable[nn.Module]) -> dict[int, MoEMLP]:
    return {
        int(i): b.mlp
        for c in chunks
        for i, b in c.layers.items()
        if isinstance(b.mlp, MoEMLP) and b.mlp.expert_bias is not None
    }


def expert_bias_state(chunks: list[nn.Module], groups: ProcessGroups, cfg: GPTConfig) -> dict[int, list[float]]:
    """``{layer id: bias as E floats}`` of every MoE layer of the model (``{}`` without
    ``moe_router_enable_expert_bias``); collective over the pp group, each stage filling in its
    layers (the others add zeros). fp32 values round-trip exactly through Python floats."""
    if cfg.num_experts is None or not cfg.moe_router_enable_expert_bias:
        return {}
    ids = [i for i in range(cfg.num_layers) if cfg.is_moe_layer(i)]
    table = torch.zeros(len(ids), cfg.num_experts, dtype=torch.float32, device=chunks[0].device)
    for i, m in _biased_layers(chunks).items():
        table[ids.index(i)] = m.expert_bias
    C.all_reduce_sum(table, groups.pp)
    return {i: row.tolist() for i, row in zip(ids, table)}


def load_expert_bias(chunks: list[nn.Module], state: dict[int, list[float]]) -> None:
    """Set each held MoE layer's expert bias from ``expert_bias_state``'s output. Raises
    ValueError naming a layer that has a bias here but none (or another size) in ``state``."""
    for i, m in _biased_layers(chunks).items():
        values = state.get(i)
        if values is None or len(values) != m.expert_bias.numel():
            raise ValueError(
                f"the checkpoint holds no expert bias of {m.expert_bias.numel()} experts for MoE "
                f"layer {i}; it was saved without --moe-router-enable-expert-bias or another "
                "--num-experts"
            )
        m.expert_bias.copy_(torch.tensor(values, dtype=m.expert_bias.dtype, device=m.expert_bias.device))
