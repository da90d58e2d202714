"""The frozen reference model of post-training (``megazero.post_training``), built in the
training layout: the application layer's part, since it builds ``model`` chunks."""

from __future__ import annotations

import copy

import torch

from megazero.checkpoint import read_partitions
from megazero.config import Config
from megazero.process_groups import ProcessGroups
from model.build import build_model_chunks
from model.config import GPTConfig
from model.gpt import VOCAB_TENSORS


def build_reference(cfg: Config, groups: ProcessGroups, gcfg: GPTConfig, device: torch.device, source: dict) -> list:
    """This rank's chunks of the reference model (same tp / pp partitions as the policy, no ZeRO
    sharding, no compile), in eval mode with gradients off, from ``source``: ``{"load": DIR}``
    (its latest checkpoint, any layout: ``megazero.checkpoint.read_partitions``, each rank reads
    its own partitions), ``{"hf": DIR}`` (a Hugging Face folder) or ``{"init": seed}`` (the seeded
    initialisation, equal to the policy's). Prints its size on rank 0. Raises CheckpointError
    (an unusable checkpoint) or HFConversionError."""
    cfg = copy.deepcopy(cfg)
    cfg.zero.stage, cfg.train.compile = 0, False
    cfg.train.from_hf = source.get("hf")
    if "init" in source:
        cfg.train.seed = source["init"]
    chunks = build_model_chunks(gcfg, cfg, groups, device, materialize="load" not in source)
    if "load" in source:
        for chunk in chunks:
            parts = read_partitions(
                source["load"],
                dict(chunk.named_parameters()),
                groups.tp_rank,
                groups.tp_size,
                real_rows=lambda name: gcfg.vocab_size if name in VOCAB_TENSORS else None,
            )[1]
            chunk.materialize(parts)
    for chunk in chunks:
        chunk.eval()
        chunk.requires_grad_(False)
    if groups.rank == 0:
        n = sum(p.numel() * p.element_size() for c in chunks for p in c.parameters())
        kind, where = next(iter(source.items()))
        print(
            f"[megazero] reference model from {kind} {where}: {n / 2**20:.2f} MiB on rank 0 "
            "(replicated over dp, no gradients or optimizer state"
            + ("; in host memory between steps, --ref-offload)" if cfg.post.ref_offload else ")"),
            flush=True,
        )
    return chunks
