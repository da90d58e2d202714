"""Packed documents on mock data, which has no tokenizer and so refuses the document flags on
the command line: the end-of-document id and flags a test gives the trainer itself, global
batches with EOD tokens at random places, and one data-parallel rank's micro-batches of them."""

import torch

EOD = 3
PACKING = dict(reset_attention_mask=True, reset_position_ids=True, eod_mask_loss=True)


def packed_batches(vocab_size: int, seq_length: int, global_batch_size: int, steps: int, seed: int = 11) -> list:
    """``steps`` global batches of (tokens, labels), each ``[global_batch_size, seq_length]``
    int64 over ids ``4 .. vocab_size-1``, about one token in five replaced by EOD."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        data = torch.randint(4, vocab_size, (global_batch_size, seq_length + 1), generator=g)
        data[torch.rand(global_batch_size, seq_length + 1, generator=g) < 0.2] = EOD
        out.append((data[:, :-1], data[:, 1:]))
    return out


def packed_trainer(argv, world_size: int):
    """A Trainer for ``argv`` (flags without the document ones) with ``PACKING`` on and EOD given."""
    from megazero.config import config_from_argv
    from megazero.training import build_trainer

    cfg = config_from_argv(list(argv), world_size)
    for k, v in PACKING.items():
        setattr(cfg.data, k, v)
    return build_trainer(cfg, eod=EOD)


def rank_micro_batches(trainer, batch) -> list:
    """This data-parallel rank's micro-batches of one global batch ``(tokens, labels)``."""
    t, dp_rank = trainer.cfg.train, trainer.groups.dp_rank
    per_dp = t.global_batch_size // trainer.cfg.parallel.dp
    tokens, labels = (x[dp_rank * per_dp : (dp_rank + 1) * per_dp] for x in batch)
    mbs = t.micro_batch_size
    return [(tokens[i : i + mbs], labels[i : i + mbs]) for i in range(0, per_dp, mbs)]
