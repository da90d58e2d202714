"""Run one stage's schedule: forward/backward of its model chunks, with the p2p transfers.

The schedule (``schedules.build_schedule``) is data; this module derives from each action
what it receives and sends, and runs it through Megatron-LM's ``forward_step`` contract:

    forward_step(batch, model_chunk, input_tensor) -> (output, loss_fn)

``input_tensor`` is None on the first virtual stage (stage 0, chunk 0: the chunk reads
``batch``'s tokens) and otherwise the activation received from the previous virtual stage
(``[B, T, H]``, a leaf with ``requires_grad``); the chunk must consume it instead of
tokens. On the last virtual stage (post-process chunk) the executor calls
``loss = loss_fn(output)``, a 0-d tensor already divided by this data-parallel rank's
token count; elsewhere ``loss_fn`` is ignored and ``output`` is sent to the next virtual
stage.

Communication: the actions are grouped (``exchange_groups``: under the interleaved schedule
a steady-phase forward with the backward after it, else one action); the sends of one group
and the receives of the next go in one batched exchange (``p2p.StageLinks.exchange``). This
gives Megatron-LM's combined exchanges (1F1B's ``send_forward_recv_backward`` and
``send_backward_recv_forward``; the interleaved schedule's four-way exchange) without a
special case per schedule; tests/unit/test_pipeline_schedules.py checks that it completes with
blocking sends.

Memory: a (micro-batch, chunk)'s input and output are kept from its forward to its
backward and dropped right after it, so 1F1B keeps at most ``pp`` micro-batches alive on
stage 0 while GPipe keeps all ``m``. Under a zero-bubble schedule each forward runs under
its own ``weight_grad.SavedTensors`` boxes, and B keeps of them only what W reads; a B
on the first virtual stage followed at once by its W (all of ZB-H1's stage 0) runs as one
plain backward after an unboxed forward (``_StageRun.adjacent``), with 1F1B's memory.
"""

from __future__ import annotations

import time
from typing import Callable, Optional, Sequence

import torch

from megazero import collectives
from megazero.context_parallel.sequence import MTPTargets
from megazero.pipeline.p2p import StageLinks, stage_rank
from megazero.pipeline.partition import stage_of, virtual_stage
from megazero.pipeline.schedules import Action, is_split, last_backward_index
from megazero.pipeline.weight_grad import SavedTensors, backward_input, backward_weight
from megazero.process_groups import ProcessGroups


def message_tag(kind: str, microbatch: int, to_virtual_stage: int, num_virtual: int) -> int:
    """Unique tag of one message: the activation ("F") or gradient ("B") of ``microbatch``
    that virtual stage ``to_virtual_stage`` receives (its sender computes the same tag)."""
    return (microbatch * num_virtual + to_virtual_stage) * 2 + (kind == "B")


def comm_plan(a: Action, pp_rank: int, pp_size: int, vp_size: int = 1, layout: str = "interleaved"):
    """What action ``a`` of stage ``pp_rank`` receives before and sends after it (pure).

    Returns ``(recv, send)``, each None or ``(direction, peer_stage, tag)`` with direction
    "prev" or "next" (ring neighbours; stage pp-1's next is stage 0 when interleaved), or
    "self" when the peer virtual stage is on this rank (the turn of the V layout).
    F of virtual stage s receives from s-1 (unless s = 0) and sends to s+1 (unless last);
    B receives from s+1 and sends to s-1; W moves nothing. In the V layout chunk 1 runs
    from the last stage back to stage 0, so its forward comes from "next" and goes to "prev".
    """
    if a.kind == "W":
        return None, None
    n = pp_size * vp_size
    s = virtual_stage(pp_rank, pp_size, a.chunk, layout)
    down = not (layout == "v" and a.chunk == 1)  # forward travels to higher ranks
    mb = a.microbatch

    def peer(v: int, toward_forward: bool):
        stage = stage_of(v, pp_size, layout)[0]
        if stage == pp_rank:
            return "self", stage
        return ("next" if toward_forward == down else "prev"), stage

    if a.kind == "F":
        recv = (*peer(s - 1, False), message_tag("F", mb, s, n)) if s > 0 else None
        send = (*peer(s + 1, True), message_tag("F", mb, s + 1, n)) if s < n - 1 else None
    else:
        recv = (*peer(s + 1, True), message_tag("B", mb, s, n)) if s < n - 1 else None
        send = (*peer(s - 1, False), message_tag("B", mb, s - 1, n)) if s > 0 else None
    return recv, send


def exchange_groups(actions: Sequence[Action]) -> list[list[int]]:
    """Indices of the actions that share one exchange (pure).

    Interleaved schedule (actions of several chunks): a steady-phase forward and the
    backward after it form one group (unless the backward needs that forward's output);
    every other action is a group of its own. The executor posts, in one batched exchange,
    the sends of group i-1 and the receives of group i, which is Megatron-LM's pattern: in
    the interleaved steady phase the stages form a ring, and sending an activation while
    waiting for a gradient in separate exchanges would deadlock around it when sends block
    (NCCL). One chunk (GPipe, 1F1B): every action is its own group, so a steady forward runs
    before the stage waits for the next backward's gradient (Megatron's
    ``send_forward_recv_backward`` after the forward); grouping them would make the two
    neighbours of a pp 2 pipeline take turns (scripts/bench/bench_pipeline.py measured a 51 %
    bubble against the ideal 11 %). Zero-bubble schedules (B/W split): one action per group.
    """
    out, i = [], 0
    if all(a.chunk == 0 for a in actions) or is_split(list(actions)):
        return [[k] for k in range(len(actions))]
    while i < len(actions):
        a = actions[i]
        b = actions[i + 1] if i + 1 < len(actions) else None
        if (
            a.kind == "F"
            and a.phase == "steady"
            and b is not None
            and b.kind == "B"
            and b.phase == "steady"
            and (a.microbatch, a.chunk) != (b.microbatch, b.chunk)
        ):
            out.append([i, i + 1])
            i += 2
        else:
            out.append([i])
            i += 1
    return out


def run_schedule(
    actions: Sequence[Action],
    model_chunks: Sequence[torch.nn.Module],
    forward_step: Callable,
    batches: Sequence,
    groups: ProcessGroups,
    *,
    tensor_shape: Sequence[int],
    dtype: torch.dtype,
    num_microbatches: int,
    vp_size: int = 1,
    before_backward: Optional[Callable[[int, bool], None]] = None,
    scale_loss: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
    device: Optional[torch.device] = None,
    forward_only: bool = False,
    busy: Optional[list] = None,
    exchanges: Optional[list] = None,
    layout: str = "interleaved",
    schedule_of: Optional[Callable[[int], Sequence[Action]]] = None,
) -> torch.Tensor:
    """Run ``actions`` (this stage's schedule) and return the summed loss.

    Args:
        model_chunks: this stage's ``vp_size`` chunks, indexed by ``Action.chunk``.
        forward_step: see the module docstring.
        batches: this data-parallel rank's ``num_microbatches`` micro-batches (the same
            list on every stage; the first stage reads tokens, the last labels).
        tensor_shape, dtype: of every activation sent between stages, e.g. ``(B, T, H)``.
        before_backward: called as ``before_backward(chunk, is_last_microbatch)`` right
            before each backward (each W when the backward is split: the parameters'
            gradients arrive there); ``is_last_microbatch`` is True for the chunk's last
            one of the step (gradient sync may start its reductions then).
        scale_loss: maps the loss to the tensor to backpropagate (fp16 loss scaling).
        device: where received tensors are allocated; default: the first chunk's
            parameters' device.
        forward_only: evaluation (``schedules.forward_only_schedule``): nothing is kept
            for a backward; run it under ``torch.no_grad()``.
        busy: when a list, ``(kind, start, end)`` is appended for every action ("F",
            "B" or "W", ``time.perf_counter()`` seconds, a clock shared by the processes of one
            machine); the rest of the step is this stage's idle time and communication
            (``scripts/bench/bench_pipeline.py``).
        exchanges: when a list, ``(posted, done, sent tags, received tags)`` is appended for
            every p2p exchange (``time.perf_counter()`` seconds; ``message_tag`` tags).
        layout: how chunks sit on stages (``partition.chunk_layout``): "v" for zb-v.
        schedule_of: zero-bubble schedules: ``schedule_of(stage)`` is that stage's action
            list. Sends are then posted without waiting, and the messages from each
            neighbour are received in the order it sent them (``_Inbox``), which NCCL needs
            (it ignores tags); without it a receive waits for its tag (gloo only).

    Returns a 0-d fp64 tensor on every rank of the pipeline: the sum of ``loss_fn`` over
    this rank's micro-batches (added in fp64, so the sum is exact to fp32 rounding for any
    number of micro-batches), computed on the stage holding the last virtual stage and
    broadcast over the pp group.
    Raises ValueError when ``len(batches)``, ``len(model_chunks)`` or a sent tensor do not
    match the configuration.
    """
    if len(batches) != num_microbatches or len(model_chunks) != vp_size:
        raise ValueError(
            f"run_schedule got {len(batches)} micro-batches for "
            f"num_microbatches {num_microbatches} and {len(model_chunks)} model "
            f"chunks for --virtual-pipeline-size {vp_size}"
        )
    if device is None:
        device = next(iter(model_chunks[0].parameters())).device
    p, r = groups.pp_size, groups.pp_rank
    run = _StageRun(actions, model_chunks, forward_step, batches, before_backward, scale_loss, forward_only, device)
    links = StageLinks(groups, tuple(tensor_shape), dtype, device, wrap=vp_size > 1 and layout == "interleaved")
    local: dict = {}  # tag -> tensor passed between two chunks of this stage (V layout)
    pending: dict = {}  # sends of the previous action, posted with the next receive
    # Zero-bubble schedules: a stage runs ahead of its receiver (ZB-V's list-scheduled order
    # sends a forward the peer takes only after several actions; ZB-H1 fills with W's the time
    # a send would wait), so sends are posted at once and waited when done or at the end of
    # the step; pairing them with the next receive would deadlock (ZB-V) or idle (ZB-H1).
    eager, posted = run.split, []
    inbox = _Inbox(links, r, p, vp_size, layout, schedule_of) if eager and schedule_of else None
    for group in exchange_groups(actions):
        plans = [comm_plan(actions[i], r, p, vp_size, layout) for i in group]
        recvs = {f"recv_{recv[0]}": recv[2] for recv, _ in plans if recv and recv[0] != "self" and inbox is None}
        got = _exchange(links, pending, recvs, exchanges)  # (from prev, from next)
        by_tag = {tag: got[0 if key == "recv_prev" else 1] for key, tag in recvs.items()}
        pending = {}
        for i, (recv, send) in zip(group, plans):
            received = None
            if recv is not None:  # (the inbox's wait for a message is idle time, not busy)
                received = (
                    local.pop(recv[2])
                    if recv[0] == "self"
                    else by_tag[recv[2]]
                    if inbox is None
                    else inbox.get(recv, exchanges, posted)
                )
            start = time.perf_counter()
            output = run.action(i, received, send is None)
            if busy is not None:
                busy.append((actions[i].kind, start, time.perf_counter()))
            if send and send[0] == "self":
                local[send[2]] = output.detach().clone()
            elif send and eager:
                posted = [(q, t, w) for q, t, w in posted if not w.is_completed()]  # free finished sends
                t_post = time.perf_counter()
                posted += [
                    (send[1], send[2], w) for w in links.post_sends(**{f"send_{send[0]}": (output.detach(), send[2])})
                ]
                if exchanges is not None:  # posted, not waited: done when posted
                    exchanges.append((t_post, t_post, [send[2]], []))
            elif send:
                pending[f"send_{send[0]}"] = (output, send[2])
            # A finished output or loss still references its graph, whose AccumulateGrad
            # node holds the received input: drop it so memory matches the schedule.
            output = None
    _exchange(links, pending, {}, exchanges)
    for _, _, work in posted:
        work.wait()
    if run.saved or run.weight_work:
        raise ValueError(f"schedule left forwards without backward or W: {sorted(run.saved) + sorted(run.weight_work)}")
    last = stage_rank(groups, stage_of(p * vp_size - 1, p, layout)[0])
    return collectives.broadcast(run.loss_sum, last, groups.pp)


class _Inbox:
    """Receives the messages of each neighbour stage in the order that stage sends them,
    keeping those that arrive before they are needed (zero-bubble schedules: a stage can
    send a forward before a gradient its peer needs first). NCCL matches the sends and
    receives of a pair of ranks in posting order, ignoring tags; so does this inbox."""

    def __init__(self, links: StageLinks, r: int, p: int, vp_size: int, layout: str, schedule_of):
        self.links, self.kept, self.queue, self.acked = links, {}, {}, {}
        for q in {(r - 1) % p, (r + 1) % p} - {r}:
            self.queue[q], consumed = [], set()
            for a in schedule_of(q):
                recv, send = comm_plan(a, q, p, vp_size, layout)
                if recv and recv[0] != "self" and recv[1] == r:
                    consumed.add(recv[2])
                if send and send[0] != "self" and send[1] == r:
                    self.queue[q].append(send[2])
                    self.acked[send[2]] = frozenset(consumed)

    def get(self, recv: tuple, record: Optional[list], posted: list) -> torch.Tensor:
        """The tensor of ``recv = (direction, peer stage, tag)``: receive the peer's messages
        in its send order up to that tag. Each message received shows which of this stage's
        sends the peer had consumed before sending it (``acked``, from the peer's schedule):
        those are waited and dropped from ``posted`` (``(peer, tag, work)``), so their tensors
        are freed then, not at the end of the step (gloo's ``is_completed`` stays False until
        ``wait``)."""
        direction, peer, tag = recv
        while tag not in self.kept:
            if not self.queue[peer]:
                raise ValueError(f"stage {peer} never sends the message tagged {tag}")
            t = self.queue[peer].pop(0)
            got = _exchange(self.links, {}, {f"recv_{direction}": t}, record)
            self.kept[t] = got[0 if direction == "prev" else 1]
            done = [i for i, (q, sent, _) in enumerate(posted) if q == peer and sent in self.acked[t]]
            for i in reversed(done):  # the peer received these: their waits return at once
                posted.pop(i)[2].wait()
        return self.kept.pop(tag)


class _StageRun:
    """The compute side of ``run_schedule``: runs one action, keeps what F leaves for B and
    (split backward) what B leaves for W, and sums the losses."""

    def __init__(self, actions, chunks, forward_step, batches, before_backward, scale_loss, forward_only, device):
        self.actions, self.chunks, self.forward_step = list(actions), chunks, forward_step
        self.batches, self.before_backward = batches, before_backward
        self.scale_loss, self.forward_only = scale_loss, forward_only
        self.split = is_split(self.actions)
        self.last_grad = last_backward_index(self.actions)
        self.saved: dict = {}  # (mb, chunk) -> (input, output or loss), F to B
        self.boxes: dict = {}  # (mb, chunk) -> weight_grad.SavedTensors, F to B (split)
        self.weight_work: dict = {}  # (mb, chunk) -> weight_grad.WeightGradWork, B to W
        # (mb, chunk) whose B is followed at once by its W; of them, those on the first
        # virtual stage (their F receives nothing) run B and W as one plain backward, their
        # forward unboxed: nobody waits for that B's input gradient, so W delays no one, and
        # it is 1F1B's computation with 1F1B's memory (a split B holds every layer's output
        # gradient until W, and the boxes cost a fused backward some 7 % more at its peak)
        self.adjacent = {
            (a.microbatch, a.chunk)
            for a, b in zip(self.actions, self.actions[1:])
            if a.kind == "B" and b.kind == "W" and (a.microbatch, a.chunk) == (b.microbatch, b.chunk)
        }
        self.fused: set = set()
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=device)

    def action(self, i: int, received: Optional[torch.Tensor], is_last_virtual: bool):
        """Run action ``i``; returns what it sends (output, input gradient) or None."""
        a = self.actions[i]
        if a.kind == "F":
            key = (a.microbatch, a.chunk)
            if self.split and received is None and key in self.adjacent and not self.forward_only:
                self.fused.add(key)  # first virtual stage, W right after B: one backward
            if self.split and not self.forward_only and key not in self.fused:
                # boxed, so B can free what W won't read
                boxes = self.boxes[(a.microbatch, a.chunk)] = SavedTensors()
                with boxes.hooks():
                    output, loss = _forward(
                        self.saved,
                        a,
                        self.chunks[a.chunk],
                        self.forward_step,
                        self.batches[a.microbatch],
                        received,
                        is_last_virtual,
                    )
            else:
                output, loss = _forward(
                    self.saved,
                    a,
                    self.chunks[a.chunk],
                    self.forward_step,
                    self.batches[a.microbatch],
                    received,
                    is_last_virtual,
                )
            if self.forward_only:
                self.saved.clear()
            if loss is not None:
                self.loss_sum += loss.detach().double()
            return output
        key = (a.microbatch, a.chunk)
        if a.kind == "W" and key in self.fused:  # its B ran the whole backward
            self.fused.discard(key)
            return None
        fuse = a.kind == "B" and key in self.fused
        if a.kind == "W" or not self.split or fuse:
            if self.before_backward is not None:  # gradients reach the buffers in this action
                self.before_backward(a.chunk, (i + 1 if fuse else i) == self.last_grad[a.chunk])
        if a.kind == "W":
            backward_weight(self.weight_work.pop(key))
            return None
        if fuse:  # nobody waits for this B's result: run B and W as one backward
            return _backward(self.saved, a, received, self.scale_loss)
        if self.split:
            return _backward_input(
                self.saved, self.weight_work, a, received, self.scale_loss, self.boxes.pop(key, None)
            )
        return _backward(self.saved, a, received, self.scale_loss)


def _exchange(links: StageLinks, sends: dict, recvs: dict, record: Optional[list]):
    """``links.exchange`` of ``sends`` and ``recvs``, timed into ``record`` when it is a list."""
    posted = time.perf_counter()
    received = links.exchange(**sends, **recvs)
    if record is not None and (sends or recvs):
        record.append((posted, time.perf_counter(), [tag for _, tag in sends.values()], list(recvs.values())))
    return received


def _forward(
    saved: dict,
    a: Action,
    chunk: torch.nn.Module,
    forward_step: Callable,
    batch,
    input_tensor: Optional[torch.Tensor],
    is_last_virtual: bool,
):
    """Run F(a); returns (output to send, None) or, on the last virtual stage, (None, loss)."""
    if input_tensor is not None:
        input_tensor.requires_grad_()
    output, loss_fn = forward_step(batch, chunk, input_tensor)
    if is_last_virtual:
        loss = loss_fn(output)
        saved[(a.microbatch, a.chunk)] = (input_tensor, loss)
        return None, loss
    saved[(a.microbatch, a.chunk)] = (input_tensor, output)
    return output, None


def _backward_input(
    saved: dict,
    weight_work: dict,
    a: Action,
    output_grad: Optional[torch.Tensor],
    scale_loss: Optional[Callable],
    boxes: Optional[SavedTensors],
) -> Optional[torch.Tensor]:
    """B(a) of a split backward: returns the input's gradient, keeps the work W will do
    (and of the forward's saved tensors, ``boxes``, only those W reads)."""
    input_tensor, output = saved.pop((a.microbatch, a.chunk))
    if output_grad is None and scale_loss is not None:
        output = scale_loss(output)
    grad, weight_work[(a.microbatch, a.chunk)] = backward_input(output, output_grad, input_tensor, boxes)
    if input_tensor is not None and grad is None:
        raise ValueError(f"{a}: forward_step did not use input_tensor, so no gradient reaches the previous stage")
    return grad


def _backward(
    saved: dict, a: Action, output_grad: Optional[torch.Tensor], scale_loss: Optional[Callable]
) -> Optional[torch.Tensor]:
    """Run B(a), free its saved tensors; returns the input's gradient (None on stage 0, chunk 0)."""
    input_tensor, output = saved.pop((a.microbatch, a.chunk))
    if output_grad is None:  # last virtual stage: ``output`` is the loss
        (scale_loss(output) if scale_loss is not None else output).backward()
    else:
        torch.autograd.backward(output, grad_tensors=output_grad)
    if input_tensor is None:
        return None
    if input_tensor.grad is None:
        raise ValueError(f"{a}: forward_step did not use input_tensor, so no gradient reaches the previous stage")
    return input_tensor.grad


def make_forward_step(tokens_per_dp_rank: float, watch=None, sequence_loss=None):
    """Megatron's ``forward_step`` contract: (batch, chunk, input) -> (output, loss_fn).

    ``batch`` is (tokens, labels), each ``(micro_batch_size, seq_length)`` int64, or (tokens,
    labels, seq) with ``seq`` the ``SequenceInfo`` of a context-parallel share or of packed
    documents (megazero/context_parallel/sequence.py: tokens and labels are then this rank's
    ``T/cp`` of each sequence), or (tokens, labels, seq or None, mtp) with multi-token
    prediction's ``MTPTargets``, passed to a last-stage chunk as ``mtp=`` (its loss joins the
    backward through the returned per-token losses, model/mtp.py); ``input`` is None on the
    first stage, else the previous stage's activation; a last-stage chunk returns its per-token
    losses ``(micro_batch_size, T(/cp))``, which ``loss_fn`` turns into this micro-batch's share
    of the loss (fp64 scalar).

    The loss of one micro-batch is its token-loss sum (targets with ``seq.loss_mask`` 0 left
    out) divided by ``tokens_per_dp_rank``: the counted targets of the global batch divided by
    the number of replica ranks (dp x cp). With the gradient reduction over those ranks (SUM,
    then divide by dp x cp) the step minimises the mean over all counted targets of the
    global batch (docs/design.md, contract 1).
    ``watch(batch, chunk, input, output) -> output`` sees every forward (``megazero.runtime.resilience.ForwardWatch``).
    ``sequence_loss(batch, per_token_loss) -> share`` replaces the token-mean loss (post-training
    losses of whole sequences: ``megazero.post_training.preference.PreferenceStep.loss``).
    """

    def forward_step(batch, chunk, input_tensor):
        tokens, labels, *rest = batch
        seq = rest[0] if rest else None
        x = tokens if input_tensor is None else input_tensor
        mtp = rest[1] if len(rest) > 1 and isinstance(rest[1], MTPTargets) else None
        extra = {"mtp": mtp} if mtp is not None and chunk.post_process else {}
        out = chunk(x, labels=labels if chunk.post_process else None, seq=seq, **extra)
        if watch is not None:
            out = watch(batch, chunk, input_tensor, out)

        def loss_fn(per_token_loss):  # summed in fp64: exact to rounding for any token count
            if sequence_loss is not None:
                return sequence_loss(batch, per_token_loss)
            if seq is not None and seq.loss_mask is not None:
                per_token_loss = per_token_loss * seq.loss_mask
            return per_token_loss.sum(dtype=torch.float64) / tokens_per_dp_rank

        return out, loss_fn

    return forward_step
