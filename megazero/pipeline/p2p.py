"""Point-to-point activation and gradient transfer between neighbouring pipeline stages.

Activations travel forward (stage p -> p+1), their gradients backward (p+1 -> p). The
receiver already knows the shape and dtype from the configuration (``[B, T, H]``, or
``[B, T/tp, H]`` with sequence parallelism), so no shape is exchanged per step; ``handshake``
checks once, before the first step, that all stages agree on it.

Every call posts its sends and receives together with ``torch.distributed.batch_isend_irecv``
and waits for all of them, as Megatron-LM's ``p2p_communication`` does: 1F1B's steady phase
needs the combined ``send_forward_recv_backward`` / ``send_backward_recv_forward`` so that two
neighbours that each send to the other do not both block in a send (deadlock under NCCL).
With the interleaved schedule the stages form a ring: the last stage sends chunk c's output
to stage 0's chunk c+1 (``wrap=True``).

Each message carries a tag (its micro-batch, virtual stage and direction). gloo matches
messages by tag; NCCL ignores tags and matches in posting order, which the schedules keep
consistent (see tests/unit/test_pipeline_schedules.py). Every send and receive is recorded in
``collectives.recent`` (its peer's global rank, shape, dtype) for failure reports.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from megazero import collectives
from megazero.process_groups import ProcessGroups


def stage_rank(groups: ProcessGroups, pp_rank: int) -> int:
    """Global rank of pipeline stage ``pp_rank % pp_size`` at this rank's other coordinates."""
    return groups.topology.rank(**groups.coord.replace(pp=pp_rank % groups.pp_size))


@dataclass
class StageLinks:
    """This stage's links to its neighbours; every method is a blocking batched exchange.

    ``tensor_shape`` and ``dtype`` describe every activation (and gradient) on the wire;
    ``device`` is where received tensors are allocated: the device of the pp group's backend
    (a CUDA device under NCCL, which has no CPU transport), so it has no default;
    ``wrap`` makes the last stage's next stage stage 0 (interleaved ring).
    """

    groups: ProcessGroups
    tensor_shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    wrap: bool = False

    def _peer(self, step: int) -> int:
        target = self.groups.pp_rank + step
        if not self.wrap and not 0 <= target < self.groups.pp_size:
            raise ValueError(f"stage {self.groups.pp_rank} has no neighbour at stage {target}")
        return stage_rank(self.groups, target)

    def post_sends(
        self, send_next: Optional[tuple[torch.Tensor, int]] = None, send_prev: Optional[tuple[torch.Tensor, int]] = None
    ) -> list:
        """Post the given sends ``(tensor, tag)`` without waiting: returns the work handles
        (wait them before the step ends; the tensors stay referenced by the handles' ops).
        Used by the V layout (zb-v), whose stages run ahead of their receivers."""
        ops = self._send_ops(send_next, send_prev)
        return list(dist.batch_isend_irecv(ops)) if ops else []

    def _send_ops(self, send_next, send_prev) -> list:
        """``P2POp`` isends of the given ``(tensor, tag)`` pairs to the next / previous stage,
        each checked against the configured shape and dtype and counted."""
        ops = []
        for sent, step in ((send_next, 1), (send_prev, -1)):
            if sent is not None:
                tensor, tag = sent
                self._check(tensor)
                collectives.count_send(tensor, self._peer(step))
                ops.append(dist.P2POp(dist.isend, tensor.detach().contiguous(), self._peer(step), self.groups.pp, tag))
        return ops

    def exchange(
        self,
        send_next: Optional[tuple[torch.Tensor, int]] = None,
        send_prev: Optional[tuple[torch.Tensor, int]] = None,
        recv_prev: Optional[int] = None,
        recv_next: Optional[int] = None,
    ) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """Post the given sends ``(tensor, tag)`` and receives (by tag), wait for all.

        Returns ``(from_prev, from_next)``: new tensors of ``tensor_shape`` / ``dtype``, or
        None where no receive was asked for. Raises ValueError when a tensor to send does
        not have the configured shape and dtype.
        """
        ops, out = self._send_ops(send_next, send_prev), [None, None]
        for i, (tag, step) in enumerate(((recv_prev, -1), (recv_next, 1))):
            if tag is not None:
                out[i] = torch.empty(self.tensor_shape, dtype=self.dtype, device=self.device)
                collectives.record("recv", (self._peer(step),), out[i])
                ops.append(dist.P2POp(dist.irecv, out[i], self._peer(step), self.groups.pp, tag))
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        return out[0], out[1]

    def _check(self, t: torch.Tensor) -> None:
        if tuple(t.shape) != tuple(self.tensor_shape) or t.dtype != self.dtype:
            raise ValueError(
                f"stage {self.groups.pp_rank} sends {tuple(t.shape)} {t.dtype}, "
                f"but the pipeline is configured for {tuple(self.tensor_shape)} "
                f"{self.dtype}"
            )

    # Megatron-LM's names for the exchanges a schedule needs.
    def send_forward(self, output: torch.Tensor, tag: int = 0) -> None:
        self.exchange(send_next=(output, tag))

    def recv_forward(self, tag: int = 0) -> torch.Tensor:
        return self.exchange(recv_prev=tag)[0]

    def send_backward(self, input_grad: torch.Tensor, tag: int = 0) -> None:
        self.exchange(send_prev=(input_grad, tag))

    def recv_backward(self, tag: int = 0) -> torch.Tensor:
        return self.exchange(recv_next=tag)[1]

    def send_forward_recv_backward(self, output: torch.Tensor, send_tag: int = 0, recv_tag: int = 0) -> torch.Tensor:
        return self.exchange(send_next=(output, send_tag), recv_next=recv_tag)[1]

    def send_backward_recv_forward(
        self, input_grad: torch.Tensor, send_tag: int = 0, recv_tag: int = 0
    ) -> torch.Tensor:
        return self.exchange(send_prev=(input_grad, send_tag), recv_prev=recv_tag)[0]


class PipelineConfigError(ValueError):
    """Stages of one pipeline disagree on a setting; raised on every rank by ``handshake``."""


_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_MAX_DIMS = 4
# Fields of the settings vector after [pp_rank]: name shown in errors, how to show a value.
_FIELDS = (
    "activation shape [B, T, H] (--micro-batch-size, --seq-length, --hidden-size, --sequence-parallel)",
    "activation dtype (--fp16 / --bf16)",
    "number of micro-batches (--global-batch-size / (--micro-batch-size x dp))",
    "--virtual-pipeline-size",
    "pipeline schedule (--pipeline-schedule)",
)
_SCHEDULES = ("none", "gpipe", "1f1b", "interleaved", "zb-h1", "zb-v")


def _settings_vector(
    pp_rank: int,
    tensor_shape: Sequence[int],
    dtype: torch.dtype,
    num_microbatches: int,
    vp_size: int,
    schedule: str,
    device: torch.device,
) -> torch.Tensor:
    if len(tensor_shape) > _MAX_DIMS:
        raise ValueError(f"activation shape {tuple(tensor_shape)} has more than {_MAX_DIMS} dims")
    shape = list(tensor_shape) + [-1] * (_MAX_DIMS - len(tensor_shape))
    dtype_code = _DTYPES.index(dtype) if dtype in _DTYPES else len(_DTYPES)
    sched_code = _SCHEDULES.index(schedule) if schedule in _SCHEDULES else len(_SCHEDULES)
    return torch.tensor(
        [pp_rank, *shape, dtype_code, num_microbatches, vp_size, sched_code], dtype=torch.int64, device=device
    )


def _fields(v: list[int]) -> list:
    """Split a settings vector (without pp_rank) into the values of ``_FIELDS``."""
    shape = tuple(d for d in v[:_MAX_DIMS] if d >= 0)
    dtype = _DTYPES[v[_MAX_DIMS]] if v[_MAX_DIMS] < len(_DTYPES) else "other"
    sched = _SCHEDULES[v[-1]] if v[-1] < len(_SCHEDULES) else "other"
    return [shape, dtype, v[_MAX_DIMS + 1], v[_MAX_DIMS + 2], sched]


def handshake(
    groups: ProcessGroups,
    tensor_shape: Sequence[int],
    dtype: torch.dtype,
    num_microbatches: int,
    vp_size: int = 1,
    schedule: str = "1f1b",
    *,
    device: torch.device,
) -> None:
    """Check once, before the first step, that all stages agree on the p2p settings.

    Three phases: (1) exchange a small int64 settings vector with both ring neighbours over
    the p2p path (checks the wiring: the peer must be the expected stage); (2) all-gather
    the vectors over the pp group, so every stage sees every stage's settings; (3) MAX
    all-reduce of an error flag over the world, so the other pipelines (data-parallel
    replicas) fail too instead of waiting in their first collective. Every tensor of the
    three phases lives on ``device``, the device the training tensors use (a CUDA device
    under NCCL: NCCL has no CPU transport, so a CPU vector would end every ``--pp > 1`` run
    here, before step 1).

    Call it once before the first ``run_schedule``: its neighbour exchange is then the first
    batched p2p call on the pp group and involves every rank of it, as NCCL's
    ``batch_isend_irecv`` requires of a group's first call.

    Raises PipelineConfigError on every rank when settings differ, naming both stages, the
    setting and both values (e.g. "stage 0 has activation shape ... (2, 8, 16) but stage
    1 has (2, 8, 32)"). Collective over the world: every rank must call it.
    """
    p, r = groups.pp_size, groups.pp_rank
    mine = _settings_vector(r, tensor_shape, dtype, num_microbatches, vp_size, schedule, device)
    problem = None
    if p > 1:
        problem = _exchange_with_neighbours(groups, mine)
        everyone = collectives.all_gather_list(mine, groups.pp)
        problem = _first_difference([t.tolist() for t in everyone]) or problem
    flag = torch.tensor([0 if problem is None else 1], dtype=torch.int64, device=device)
    collectives.all_reduce_max(flag, groups.world)
    if problem is not None:
        raise PipelineConfigError(f"pipeline handshake failed: {problem}")
    if flag.item() > 0:
        raise PipelineConfigError(
            "pipeline handshake failed in another pipeline (another data-parallel replica); see the errors of its ranks"
        )


def _exchange_with_neighbours(groups: ProcessGroups, mine: torch.Tensor) -> Optional[str]:
    p, r = groups.pp_size, groups.pp_rank
    links = StageLinks(groups, tuple(mine.shape), mine.dtype, mine.device, wrap=True)
    tag = 1 << 20  # apart from the schedule's tags
    if p == 2:
        got = {r + 1: links.exchange(send_next=(mine, tag), recv_next=tag)[1]}
    else:
        frm_prev, frm_next = links.exchange(
            send_next=(mine, tag), send_prev=(mine, tag + 1), recv_prev=tag, recv_next=tag + 1
        )
        got = {r - 1: frm_prev, r + 1: frm_next}
    for step, t in got.items():
        if int(t[0]) != step % p:
            return (
                f"stage {r} expected stage {step % p} as a neighbour but heard from "
                f"stage {int(t[0])}: the pp process groups are wired wrongly"
            )
    return None


def _first_difference(vectors: list[list[int]]) -> Optional[str]:
    base = _fields(vectors[0][1:])
    for v in vectors[1:]:
        other = _fields(v[1:])
        for name, a, b in zip(_FIELDS, base, other):
            if a != b:
                return f"stage {vectors[0][0]} has {name} = {a} but stage {v[0]} has {b}"
    return None
