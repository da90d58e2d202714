"""Model-state bytes per rank against the ZeRO formula, counted from the tensors' storages.

At dp 2 and dp 4, for an fp32 model (whose parameters are its main params: no second copy)
and a bf16 one: the bytes of every distinct storage the data-parallel layer and the optimizer
hold equal ``zero_formula_bytes`` exactly, the step's temporaries equal the printed bound at
stages 0/1 and stay under it at stage 2 (staging depends on gradient arrival), and both totals (states + temporaries,
formula + bound) strictly fall from ZeRO-0
to ZeRO-1 to ZeRO-2.
"""

import torch

from megazero.optim.zero import zero_formula_bytes
from megazero.planning.activations import temporary_bytes
from megazero.process_groups import ProcessGroups
from megazero.topology import Topology
from tests.support.distributed import run_distributed
from tests.support.zero import build, make_batches, tiny_cfg, train

MODELS = {  # fp32: big enough that one bucket is small beside the model; bf16: tiny
    "fp32": dict(vocab_size=256, num_layers=2, hidden_size=48, num_attention_heads=4),
    "bf16": dict(params_dtype=torch.bfloat16),
}


def _storage_bytes(ddp, opt) -> int:
    """Bytes of the distinct storages behind the params, grads and optimizer state."""
    tensors = [p.data for p in ddp.params] + [b.grads for b in ddp.buffers]
    tensors += [opt._main, opt.exp_avg, opt.exp_avg_sq]
    seen = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def _measure(rank, world, batches):
    groups = ProcessGroups.build(Topology(tp=1, pp=1, dp=world))
    out = {}
    for kind, kw in MODELS.items():
        cfg = tiny_cfg(**kw)
        bucket = cfg.hidden_size**2  # train.py's default bucket size
        grad_dtype = cfg.params_dtype
        for stage in (0, 1, 2):
            model, ddp, opt = build(cfg, groups, stage, True, bucket=bucket, grad_dtype=grad_dtype)
            opt.allgather_bucket_size = bucket
            *_, state_bytes = train(model, ddp, opt, groups, batches, 2, steps=2)
            padded = sum(b.layout.padded_numel for b in ddp.buffers)
            p_bytes = grad_bytes = cfg.params_dtype.itemsize
            out[kind, stage] = dict(
                got=state_bytes[-1],
                storage=_storage_bytes(ddp, opt),
                bound=opt.bucket_bound_bytes(),
                formula=zero_formula_bytes(padded, world, stage, p_bytes, grad_bytes),
                psi=sum(p.numel() for p in ddp.params),
                padded=padded,
                plan=max(
                    temporary_bytes(
                        sum(p.numel() for p in ddp.params), world, stage, p_bytes, grad_bytes, bucket, bucket
                    )
                ),
                fp32_main_aliases=all(
                    p.data.untyped_storage().data_ptr() == ddp.buffers[0].params_flat.untyped_storage().data_ptr()
                    for p in ddp.params
                ),
            )
    return out


def _check(results, world):
    for out in results:
        for kind in MODELS:
            totals, predicted = [], []
            for stage in (0, 1, 2):
                r = out[kind, stage]
                got = r["got"]
                states = got["total"] - got["buckets"]
                assert r["storage"] == states == r["formula"], (kind, stage)
                assert 0 <= got["buckets"] <= r["bound"], (kind, stage)
                assert r["plan"] == r["bound"], (kind, stage, r["plan"], r["bound"])  # the planner's bound
                if stage < 2:  # no staging: the step's temporaries are exactly the bound
                    assert got["buckets"] == r["bound"], (kind, stage)
                totals.append(got["total"])
                predicted.append(r["formula"] + r["bound"])
            assert totals[0] > totals[1] > totals[2], (kind, totals)
            assert predicted[0] > predicted[1] > predicted[2], (kind, predicted)
            psi = out[kind, 0]["padded"]
            if kind == "fp32":  # 16, 8 + 8/N, 4 + 12/N bytes per parameter
                assert out[kind, 0]["fp32_main_aliases"]
                assert [out[kind, s]["formula"] for s in (0, 1, 2)] == [
                    16 * psi,
                    8 * psi + 8 * psi / world,
                    4 * psi + 12 * psi / world,
                ]
            else:  # the paper's 16, 4 + 12/N, 2 + 14/N
                assert [out[kind, s]["formula"] for s in (0, 1, 2)] == [
                    16 * psi,
                    4 * psi + 12 * psi / world,
                    2 * psi + 14 * psi / world,
                ]


def test_model_state_bytes_fall_with_each_stage_dp2_dp4():
    batches = make_batches(tiny_cfg(vocab_size=50), 2)
    for world in (2, 4):
        _check(run_distributed(_measure, world, batches), world)
