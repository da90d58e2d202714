"""Memory per rank before anything is allocated: model states (exact) and activations (estimate).

The launcher's preflight prints these numbers and refuses a run whose model states alone do
not fit, so a model that cannot fit ends in a second with one line instead of an
out-of-memory kill minutes later (docs/design.md, contracts 2 and 3).

- Parameters per rank are counted from the model's parameter spec (``param_spec``: every
  parameter with its full shape and TP partition, declared once by ``model/``), read
  through ``ModelSizes.parameter_spec`` (a test checks the count against built stages under
  every layout, for the GPT-2 and the LLaMA-style block). For the GPT-2 block with hidden
  size ``h``, FFN size ``f`` and TP size ``t`` a layer holds
  ``(4h^2 + 2hf + 3h + f)/t + 2h + 4h``; stage 0 adds the word embedding ``V_pad/t * h``
  and the position embedding ``max_pos * h``; the last stage the final norm and, when it does
  not hold the word embedding already, the output layer ``V_pad/t * h`` (a tied copy with
  pp > 1, or the untied output weight).
- Model-state bytes follow the ZeRO formulas (``optim.zero.zero_formula_bytes``).
- Activations follow Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
  Transformer Models", sec. 4.1, eq. 1-2): one layer of one micro-batch keeps
  ``s*b*h*(10 + 24/t + 5*a*s/(h*t))`` bytes with 16-bit activations and tensor parallelism,
  ``s*b*h*(34 + 5*a*s/h)/t`` with sequence parallelism as well (``a`` heads). With fp32
  activations the count is doubled. The ``5*a*s/h`` term (attention scores, softmax,
  dropout mask) is kept although fused attention kernels do not store it: an upper bound.
  The formula is the GPT-2 block's; for the LLaMA-style block (smaller K/V with grouped
  queries, SwiGLU's two F-wide inputs to the gate) it stays an estimate of the same order.
  A stage holds as many micro-batch-chunks at once as its schedule's peak
  (``pipeline.schedules.simulate``: 1F1B about ``pp - stage``, GPipe every micro-batch);
  the last stage adds the fp32 logits and their softmax, ``2 * 4*b*s*V_pad/t`` bytes.
  With context parallelism a rank holds ``s/cp`` tokens: every per-token term is divided by
  cp and the ``5*a*s/h`` term counts ``s/cp`` queries against ``s`` keys.
- ``estimate`` with ``ActivationSettings`` counts instead what megazero's layers keep,
  tensor by tensor (``megazero.planning.activations``: dropout masks, the unfused attention core,
  selective / full recomputation, sequence parallelism), and the temporaries of the
  reduction and of the step; the peak per rank is ``states + max(activations + backward
  temporaries, step temporaries)`` (activations are freed before the step). At cp > 1 that
  count includes the cp attention's buffers (the ring's K/V blocks, ``ContextParallelBytes``),
  and ZeRO shards over the ``dp x cp`` ranks that hold the same parameters (pass that
  product as ``dp``). Under hybrid sharding (``--zero-shard-size S``) the state is sharded over
  S ranks and replicated across the rest: the formulas hold with N = S (pass S as ``dp``), and
  with expert parallelism N = S / EP for the expert state (the edp ranks of one shard group).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Optional, Protocol

from megazero.data_parallel.policy import sharding_policy
from megazero.optim.offload import offload_formula_bytes
from megazero.optim.zero import zero_formula_bytes
from megazero.param_spec import ParamSpec, gather_units, params_on_chunk
from megazero.pipeline import partition
from megazero.pipeline.schedules import build_schedule, inflight_pairs_of, simulate
from megazero.planning import activations as A


class ModelSizes(Protocol):
    """The sizes this module reads (``model.config.GPTConfig`` has them; megazero does not
    import ``model``, docs/design.md "Dependency direction")."""

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    kv_heads: int
    """Key/value heads G (the heads, without grouped-query attention)."""
    seq_length: int
    max_position_embeddings: int
    tie_embeddings: bool

    def padded_vocab(self, tp_size: int) -> int: ...

    def parameter_spec(self, tp_size: int) -> list[ParamSpec]:
        """Every parameter of the model with the vocabulary padded for ``tp_size`` ranks."""
        ...


def params_per_rank(
    g: ModelSizes,
    tp: int,
    pp: int,
    pp_rank: int,
    vp_size: int = 1,
    layer_split=None,
    ep: int = 1,
    layout: str = "interleaved",
    etp: Optional[int] = None,
) -> int:
    """Parameters (elements) held by one rank of stage ``pp_rank`` (all its chunks), summed
    from ``g.parameter_spec(tp)`` over the layers, embedding and head of each chunk
    (``layout``: ``partition.chunk_layout`` of the schedule). With expert parallelism ``ep`` a
    rank holds E/ep of each MoE layer's routed experts (every ep rank the same number: those of
    ep rank 0 are counted); with expert tensor parallelism ``etp`` (None = tp) each routed
    expert's partitioned tensors are cut over etp ranks, not tp."""
    spec = [e for e in g.parameter_spec(tp) if _held(e.name, g, ep)]
    return _on_rank(g, spec, tp, pp, pp_rank, vp_size, layer_split, layout, etp)


def _on_rank(g, spec, tp, pp, pp_rank, vp_size, layer_split, layout, etp) -> int:
    """Elements of ``spec``'s entries on one rank of stage ``pp_rank``: the routed experts'
    partitions at ``etp`` (None = tp), every other partition at tp."""
    routed = [e for e in spec if ".mlp.experts." in e.name]
    dense = [e for e in spec if ".mlp.experts." not in e.name]
    return sum(
        params_on_chunk(
            part,
            partition.layer_ids(g.num_layers, pp, pp_rank, vp_size, v, layer_split, layout),
            partition.is_pre_process(pp_rank, v),
            partition.is_post_process(pp_rank, pp, v, vp_size, layout),
            size,
        )
        for part, size in ((dense, tp), (routed, tp if etp is None else etp))
        for v in range(vp_size)
    )


def _held(name: str, g: ModelSizes, ep: int) -> bool:
    """Whether ep rank 0 holds parameter ``name`` (every parameter but the routed experts past
    its E/ep)."""
    return ".mlp.experts." not in name or int(name.split(".mlp.experts.")[1].split(".")[0]) < g.num_experts // ep


def expert_params_per_rank(
    g: ModelSizes,
    tp: int,
    pp: int,
    pp_rank: int,
    vp_size: int = 1,
    layer_split=None,
    ep: int = 1,
    layout: str = "interleaved",
    etp: Optional[int] = None,
) -> int:
    """The routed-expert elements among ``params_per_rank``'s (E/ep experts of each MoE layer, cut
    over ``etp`` ranks): the parameters reduced and sharded over the expert-data-parallel ranks
    (0 for a dense model)."""
    spec = [e for e in g.parameter_spec(tp) if ".mlp.experts." in e.name and _held(e.name, g, ep)]
    return _on_rank(g, spec, tp, pp, pp_rank, vp_size, layer_split, layout, etp)


def zero3_units(
    g: ModelSizes,
    tp: int,
    pp: int,
    pp_rank: int,
    vp_size: int = 1,
    layer_split=None,
    persistence_threshold: int = 0,
    layout: str = "interleaved",
) -> list[dict[str, int]]:
    """ZeRO-3 gather units of each model chunk of stage ``pp_rank``: unit name -> elements on one
    rank (``param_spec.gather_units``, from ``g.parameter_spec(tp)``)."""
    spec = g.parameter_spec(tp)
    return [
        gather_units(
            spec,
            partition.layer_ids(g.num_layers, pp, pp_rank, vp_size, v, layer_split, layout),
            partition.is_pre_process(pp_rank, v),
            partition.is_post_process(pp_rank, pp, v, vp_size, layout),
            tp,
            persistence_threshold,
        )
        for v in range(vp_size)
    ]


def zero3_gathered_at_once(chunks: list[dict[str, int]]) -> int:
    """Elements a rank holds gathered at once whatever ``--zero3-max-live-parameters`` says, as
    ``DataParallel.gathered_bound_bytes`` counts them: the largest chunk's own unit (gathered
    around the whole chunk) plus the two largest other units (the one computing and the one
    whose backward is finishing), never more than all units."""
    rest = max((c.get("chunk", 0) for c in chunks), default=0)
    top = sorted((n for c in chunks for k, n in c.items() if k != "chunk"), reverse=True)[:2]
    return min(rest + sum(top), sum(n for c in chunks for n in c.values()))


def activation_bytes_per_layer(
    g: ModelSizes, micro_batch_size: int, tp: int, sequence_parallel: bool, activation_bytes: int, cp: int = 1
) -> float:
    """Bytes one transformer layer keeps for the backward of one micro-batch (Korthikanti eq. 1-2),
    on a rank holding ``s/cp`` of the ``s`` tokens (its queries score against all ``s`` keys)."""
    s, b, h, a = g.seq_length, micro_batch_size, g.hidden_size, g.num_attention_heads
    s_local = s // cp
    if sequence_parallel:
        per = s_local * b * h * (34 + 5 * a * s / h) / tp
    else:
        per = s_local * b * h * (10 + 24 / tp + 5 * a * s / (h * tp))
    return per * activation_bytes / 2


@dataclass
class MemoryEstimate:
    """Bytes per rank of the most loaded stage (``stage``)."""

    stage: int
    params: int
    """Parameters (elements) on one rank of that stage (Psi)."""
    model_state_bytes: float
    """ZeRO formula for Psi (exact up to buckets and padding)."""
    activation_bytes: float
    """Upper-bound estimate (see the module docstring)."""
    zero_stage: int = 0
    dp: int = 1
    most_states: Optional["MemoryEstimate"] = None
    """The stage whose model states alone are largest (None: this one)."""
    backward_temporary_bytes: float = 0.0
    """Reduction staging alive with the activations (``activations.temporary_bytes``)."""
    step_temporary_bytes: float = 0.0
    """The optimizer step's temporaries, alive after the activations are freed."""
    cp_attention: A.ContextParallelBytes = A.ContextParallelBytes(0.0, 0.0)
    """The cp attention's buffers alive inside one layer (the ring's K/V and blocks); counted
    in ``activation_bytes`` where larger than the logits and FFN gradient (zeros at cp = 1)."""
    reference_bytes: float = 0.0
    """Post-training's frozen reference model on this rank (``--post-train dpo``): the stage's
    Psi parameters in the model dtype, replicated over dp, no gradients or optimizer state; 0
    without one, or when ``--ref-offload`` keeps it off the planned memory (a GPU's)."""

    @property
    def temporary_bytes(self) -> float:
        return max(self.backward_temporary_bytes, self.step_temporary_bytes)

    @property
    def total_bytes(self) -> float:
        """Peak bytes: states + reference + max(activations + backward temporaries, step
        temporaries)."""
        return (
            self.model_state_bytes
            + self.reference_bytes
            + max(self.activation_bytes + self.backward_temporary_bytes, self.step_temporary_bytes)
        )


def inflight_per_stage(schedule: str, pp: int, vp_size: int, num_microbatches: int) -> list[int]:
    """Peak micro-batch-chunks alive per stage. GPipe keeps all ``m``; for 1F1B and the
    interleaved schedule the peak stops growing once ``m`` passes a few times ``pp``, so they
    are simulated with at most ``4 pp`` micro-batches (a multiple of pp, as interleaving needs)."""
    return list(_simulated_inflight(schedule, pp, vp_size, num_microbatches))


@functools.lru_cache(maxsize=256)
def _simulated_inflight(schedule: str, pp: int, vp_size: int, num_microbatches: int) -> tuple[int, ...]:
    """``inflight_per_stage``, cached: a layout search (python -m scripts.plan --devices) asks for the same
    schedules many times."""
    if pp == 1:
        return (1,)
    if schedule == "gpipe":
        return (num_microbatches * vp_size,) * pp
    m = min(num_microbatches, 4 * pp)
    actions = [build_schedule(schedule, m, pp, r, vp_size) for r in range(pp)]
    return tuple(simulate(actions, pp, vp_size, layout=partition.chunk_layout(schedule)).peak_inflight)


@functools.lru_cache(maxsize=256)
def _inflight_pairs(schedule: str, pp: int, vp_size: int, num_microbatches: int) -> tuple[tuple, ...]:
    """Per stage, ``schedules.inflight_pairs_of``: the (kept, awaiting W) micro-batch-chunk
    counts that can make its peak; ``((in flight, 0),)`` for a schedule without W."""
    if pp == 1 or schedule not in ("zb-h1", "zb-v"):
        return tuple(((n, 0),) for n in inflight_per_stage(schedule, pp, vp_size, num_microbatches))
    m = min(num_microbatches, 4 * pp)
    return tuple(inflight_pairs_of(build_schedule(schedule, m, pp, r, vp_size)) for r in range(pp))


def estimate(
    g: ModelSizes,
    *,
    tp: int,
    pp: int,
    dp: int,
    vp_size: int,
    layer_split,
    schedule: str,
    micro_batch_size: int,
    num_microbatches: int,
    zero_stage: int,
    param_bytes: int,
    grad_bytes: int,
    sequence_parallel: bool,
    activations: Optional[A.ActivationSettings] = None,
    buckets: Optional[tuple] = None,
    states_on_host: bool = False,
    cp: int = 1,
    ep: int = 1,
    params_on_host: bool = False,
    reference: bool = False,
    etp: Optional[int] = None,
    muon: bool = False,
) -> MemoryEstimate:
    """The stage with the largest model states plus activations, and its numbers (bytes);
    ``.most_states`` is the stage with the largest model states alone (``check_fits`` tests it).

    With ``activations`` the activations are counted per tensor (``megazero.planning.activations``)
    and, with ``buckets`` = (reduce, all-gather bucket elements[, buckets in flight, ZeRO-3
    max live parameters]), the temporaries too (``activations.temporary_bytes``);
    without, the Korthikanti bound below is used. ``states_on_host``: the optimizer is
    offloaded to another memory than the one planned (``--offload-optimizer cpu`` on a GPU),
    so only the device part of ``optim.offload.offload_formula_bytes`` counts;
    ``params_on_host``: ZeRO-3's parameter shards live there too (``--offload-param cpu|nvme``
    on a GPU), so their ``p Psi / N`` leaves the device's count as well (the gathered parameters
    stay among the temporaries). ``cp``: the
    context-parallel size of the bound (the counted path reads ``activations.cp``); ``dp`` is
    the number of ranks ZeRO shards over, ``dp x cp`` with context parallelism; ``ep`` the
    expert-parallel size (a rank holds E/ep experts, their states sharded over ``dp / ep``: the
    edp size, or S / EP under hybrid sharding) and ``etp`` the experts' tensor-parallel size
    (None = tp; at etp < tp an expert's partition is 1/etp and its states shard over
    ``(tp / etp) x dp / ep``);
    ``reference``: a frozen reference model in the planned memory (``MemoryEstimate.reference_bytes``);
    ``muon``: ``--optimizer muon``, one fp32 moment on the hidden matrices (``muon_saved_bytes``)."""
    if activations is not None:
        return _estimate_counted(
            g,
            tp=tp,
            pp=pp,
            dp=dp,
            vp_size=vp_size,
            layer_split=layer_split,
            schedule=schedule,
            num_microbatches=num_microbatches,
            zero_stage=zero_stage,
            param_bytes=param_bytes,
            grad_bytes=grad_bytes,
            a=activations,
            buckets=buckets or (2**62, 2**62),
            states_on_host=states_on_host,
            ep=ep,
            params_on_host=params_on_host,
            reference=reference,
            etp=etp,
            muon=muon,
        )
    inflight = inflight_per_stage(schedule, pp, vp_size, num_microbatches)
    layer = activation_bytes_per_layer(g, micro_batch_size, tp, sequence_parallel, param_bytes, cp)
    logits = 2 * 4 * micro_batch_size * g.seq_length // cp * g.padded_vocab(tp) / tp
    stages = []
    layout = partition.chunk_layout(schedule)
    for r in range(pp):
        psi, states = _stage_states(
            g,
            tp,
            pp,
            r,
            vp_size,
            layer_split,
            ep,
            schedule,
            dp,
            zero_stage,
            param_bytes,
            grad_bytes,
            states_on_host,
            params_on_host,
            etp,
            muon,
        )
        layers_per_chunk = len(partition.layer_ids(g.num_layers, pp, r, vp_size, 0, layer_split))
        head = r == partition.stage_of(pp * vp_size - 1, pp, layout)[0]
        acts = inflight[r] * layers_per_chunk * layer + (logits if head else 0.0)
        ref = psi * param_bytes * reference
        stages.append(MemoryEstimate(r, psi, states, acts, zero_stage, dp, reference_bytes=ref))
    best = max(stages, key=lambda e: e.total_bytes)
    best.most_states = max(stages, key=lambda e: e.model_state_bytes + e.reference_bytes)
    return best


def _stage_states(
    g,
    tp,
    pp,
    r,
    vp_size,
    layer_split,
    ep,
    schedule,
    dp,
    zero_stage,
    param_bytes,
    grad_bytes,
    states_on_host,
    params_on_host,
    etp=None,
    muon=False,
) -> tuple:
    """(Psi, model-state bytes by part) of pipeline stage ``r``: its parameters under the
    schedule's chunk layout, and ``_states`` of them (expert parameters apart when ep > 1 or
    etp < tp, sharded over the (tp / etp) x dp / ep expert-data-parallel ranks), less
    ``muon_saved_bytes`` with ``muon``."""
    layout = partition.chunk_layout(schedule)
    etp = tp if etp is None else etp
    psi = params_per_rank(g, tp, pp, r, vp_size, layer_split, ep, layout, etp)
    apart = ep > 1 or etp < tp
    experts = expert_params_per_rank(g, tp, pp, r, vp_size, layer_split, ep, layout, etp) if apart else 0
    edp = dp // ep * (tp // etp)
    states = _states(psi, dp, zero_stage, param_bytes, grad_bytes, states_on_host, experts, edp, params_on_host)
    if muon:
        states -= muon_saved_bytes(g, tp, pp, r, vp_size, layer_split, ep, layout, etp, dp, edp, zero_stage)
    return psi, states


def muon_saved_bytes(
    g: ModelSizes, tp, pp, pp_rank, vp_size, layer_split, ep, layout, etp, dp, edp, zero_stage
) -> float:
    """Bytes ``--optimizer muon`` saves per rank of stage ``pp_rank``: 4 per hidden-matrix element
    (a 2-D ``layer`` entry of the spec: one fp32 moment instead of Adam's two), divided by the
    ranks the optimizer state is sharded over (dp, the routed experts' over ``edp``; 1 at stage 0).
    On average over a shard group: the shard boundaries decide each rank's exact share."""
    shards = sharding_policy(zero_stage).shards_optimizer
    hidden = [e for e in g.parameter_spec(tp) if e.part == "layer" and len(e.shape) == 2 and _held(e.name, g, ep)]
    routed = [e for e in hidden if ".mlp.experts." in e.name]
    dense = [e for e in hidden if ".mlp.experts." not in e.name]
    out = 0.0
    for spec, n in ((dense, dp), (routed, edp)):
        out += 4 * _on_rank(g, spec, tp, pp, pp_rank, vp_size, layer_split, layout, etp) / (n if shards else 1)
    return out


def _states(
    psi,
    dp,
    zero_stage,
    param_bytes,
    grad_bytes,
    states_on_host: bool,
    experts: int = 0,
    edp: int = 1,
    params_on_host: bool = False,
) -> float:
    """Model-state bytes in the planned memory: the ZeRO formula, or with the optimizer
    offloaded elsewhere only its device part (params and grads), without the ZeRO-3 parameter
    shards (``p Psi / N``) when ``params_on_host`` too; with expert parallelism the
    ``experts`` among the ``psi`` elements are sharded over the ``edp`` expert-data-parallel
    ranks, the rest over dp."""
    if experts:
        return _states(
            psi - experts, dp, zero_stage, param_bytes, grad_bytes, states_on_host, params_on_host=params_on_host
        ) + _states(experts, edp, zero_stage, param_bytes, grad_bytes, states_on_host, params_on_host=params_on_host)
    if states_on_host:
        device = offload_formula_bytes(psi, dp, zero_stage, param_bytes, grad_bytes)["device"]
        return device - (
            param_bytes * psi / dp if params_on_host and sharding_policy(zero_stage).shards_params else 0.0
        )
    return zero_formula_bytes(psi, dp, zero_stage, param_bytes, grad_bytes)


def _estimate_counted(g: ModelSizes, **kw) -> MemoryEstimate:
    """``estimate`` with activations and temporaries counted (``megazero.planning.activations``)."""
    stages = stage_estimates(g, **kw)
    best = max(stages, key=lambda e: e.total_bytes)
    best.most_states = max(stages, key=lambda e: e.model_state_bytes + e.reference_bytes)
    return best


def stage_estimates(
    g: ModelSizes,
    *,
    tp: int,
    pp: int,
    dp: int,
    vp_size: int,
    layer_split,
    schedule: str,
    num_microbatches: int,
    zero_stage: int,
    param_bytes: int,
    grad_bytes: int,
    a: A.ActivationSettings,
    buckets: tuple,
    states_on_host: bool = False,
    ep: int = 1,
    params_on_host: bool = False,
    reference: bool = False,
    etp: Optional[int] = None,
    muon: bool = False,
) -> list[MemoryEstimate]:
    """One ``MemoryEstimate`` per pipeline stage (every rank of a stage holds the same bytes):
    ZeRO-formula model states, counted activations (``megazero.planning.activations``) and temporaries."""
    stages = []
    layout = partition.chunk_layout(schedule)
    for r in range(pp):
        psi, states = _stage_states(
            g,
            tp,
            pp,
            r,
            vp_size,
            layer_split,
            ep,
            schedule,
            dp,
            zero_stage,
            param_bytes,
            grad_bytes,
            states_on_host,
            params_on_host,
            etp,
            muon,
        )
        ids = [partition.layer_ids(g.num_layers, pp, r, vp_size, v, layer_split, layout) for v in range(vp_size)]
        chunks, windows = [len(i) for i in ids], [A.layer_windows(g, i) for i in ids]
        head = r == partition.stage_of(pp * vp_size - 1, pp, layout)[0]
        acts = max(
            A.stage_activation_bytes(g, a, chunks, kept, r == 0, head, pp, g.padded_vocab(tp), waiting, windows)
            for kept, waiting in _inflight_pairs(schedule, pp, vp_size, num_microbatches)[r]
        )
        staging, step = A.temporary_bytes(psi, dp, zero_stage, param_bytes, grad_bytes, *buckets)
        cp_bytes = A.context_parallel_bytes(g, a, any(w is not None for ws in windows for w in ws))
        ref = psi * param_bytes * reference
        stages.append(MemoryEstimate(r, psi, states, acts, zero_stage, dp, None, staging, step, cp_bytes, ref))
    return stages


def available_bytes_per_rank(device: str, ranks_per_node: int) -> Optional[int]:
    """Free memory one rank may use: a GPU's free bytes (``torch.cuda.mem_get_info``), or on
    CPU ``MemAvailable`` of /proc/meminfo shared by this node's ranks. None when unknown."""
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            return None
        return int(torch.cuda.mem_get_info()[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024 // max(ranks_per_node, 1)
    except OSError:
        pass
    return None


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def describe(e: MemoryEstimate, available: Optional[int]) -> str:
    """One line for the launcher's console."""
    free = gib(available) if available is not None else "unknown"
    temps = f" + temporaries {gib(e.temporary_bytes)}" if e.temporary_bytes else ""
    cp = e.cp_attention
    ring = (
        (
            f"; one layer's context-parallel attention holds {gib(cp.total)} at once: K/V buffers "
            f"{gib(cp.kv_buffers)}, block scores {gib(cp.scores)}"
        )
        if cp.total
        else ""
    )
    reference = f" + reference model {gib(e.reference_bytes)}" if e.reference_bytes else ""
    return (
        f"memory per rank (pipeline stage {e.stage}): model states {gib(e.model_state_bytes)} "
        f"(Psi={e.params:,}, ZeRO formula){reference} + activations up to {gib(e.activation_bytes)} "
        f"(Korthikanti et al. 2022{ring}){temps}, peak {gib(e.total_bytes)}; available {free}"
    )


def ranks_per_node() -> int:
    """``LOCAL_WORLD_SIZE`` under torchrun, else the launcher's ``MEGAZERO_RANKS_PER_NODE``, else 1."""
    return int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("MEGAZERO_RANKS_PER_NODE") or 1)


class MemoryPlanError(ValueError):
    """The model states of one rank exceed the memory it has (found before any allocation)."""


def check_fits(e: MemoryEstimate, available: Optional[int]) -> Optional[str]:
    """Raise MemoryPlanError when the model states of any stage alone exceed ``available``
    bytes; return a warning (str) when states plus the activation estimate do, else None."""
    if available is None:
        return None
    worst = e.most_states or e
    if worst.model_state_bytes + worst.reference_bytes > available:
        policy = sharding_policy(worst.zero_stage)
        fixes = [policy.remedy] if policy.remedy else []
        if policy.shards_optimizer:
            fixes.append("a larger --dp")
        ref = ""
        if worst.reference_bytes:
            ref = f" and the reference model {gib(worst.reference_bytes)}"
            fixes.append("--ref-offload")
        fixes += [
            "a larger --tp or --pp",
            "a smaller model (--num-layers, --hidden-size, "
            "--max-position-embeddings, or a tokenizer with fewer tokens)",
        ]
        raise MemoryPlanError(
            f"the model states of one rank of pipeline stage {worst.stage} need {gib(worst.model_state_bytes)} "
            f"(Psi={worst.params:,} parameters, ZeRO-{worst.zero_stage}){ref} but {gib(available)} is available; "
            f"fix: {', '.join(fixes)}"
        )
    if e.total_bytes > available:
        return (
            f"activations may not fit: up to {gib(e.activation_bytes)} on top of "
            f"{gib(e.model_state_bytes)} of model states, {gib(available)} available; fix: a "
            f"smaller --micro-batch-size or --seq-length, --sequence-parallel, larger --tp or --pp"
        )
    return None
