"""Training monitor: console lines, TensorBoard scalars (also sent to Weights & Biases with
``--wandb-project``), a JSON-lines metrics file, timers,
peak memory, and the unigram-entropy baseline. FLOP accounting and MFU are in
``megazero/planning/flops.py`` (re-exported here).

Only the logging rank writes (the trainer picks it: the last pipeline stage, tensor-parallel
rank 0, data-parallel rank 0, which holds the loss); on every other rank the ``Monitor``
methods do nothing, except :meth:`Monitor.log_memory_breakdown`, which every rank prints.

Console line of :meth:`Monitor.log_iteration` (Megatron-LM's fields, one line; a value the
trainer did not supply is shown as ``n/a``)::

    iteration 10/100 | consumed samples: 80 | elapsed time per iteration (ms): 52.1 |
    tokens/s: 9830.2 | TFLOP/s/device: 0.012 | MFU: n/a | learning rate: 3.000E-04 |
    loss: 5.312345E+00 | grad norm: 1.234 | loss scale: 65536 | skipped iterations: 0 |
    model state: 12.34 MiB | peak memory: 210.50 MiB

TensorBoard scalars (x-axis = iteration; TensorBoard stores them as float32):

=============================  =====================  =======================================
tag                            values key             unit
=============================  =====================  =======================================
``train/loss``                 ``loss``               nats/token, mean over the global batch
``train/lr``                   ``lr``                 learning rate
``train/grad_norm``            ``grad_norm``          global L2 norm of the unscaled gradient
``train/loss_scale``           ``loss_scale``         fp16 loss scale (1 for bf16/fp32)
``train/skipped_iterations``   ``skipped_iterations`` count of overflow-skipped steps so far
``train/consumed_samples``     ``consumed_samples``   samples (sequences) trained on so far
``perf/iteration_time_s``      ``iteration_time_s``   seconds per iteration (wall clock)
``perf/tokens_per_s``          ``tokens_per_s``       tokens/s, all devices together
``perf/tflops_per_device``     ``tflops_per_device``  achieved TFLOP/s (1e12) per device
``perf/mfu``                   ``mfu``                fraction of peak (0.42 = 42 %)
``memory/model_state_bytes``   ``model_state_bytes``  bytes of params+grads+optimizer states
``memory/peak_bytes``          ``peak_memory_bytes``  bytes, see :func:`memory_stats`
``train/moe_aux_loss``         ``moe_aux_loss``       MoE: load-balancing loss added
``train/moe_z_loss``           ``moe_z_loss``         MoE: router z-loss added
``train/mtp_loss``             ``mtp_loss``           multi-token prediction: lambda / D x the
                                                      depths' cross-entropies, added to the loss
``dpo/rewards_chosen`` ...     ``rewards_chosen``...  --post-train dpo: mean implicit rewards of the
                                                      chosen and rejected responses, reward accuracy
                                                      and margin over the global batch's pairs
``rm/accuracy`` ...            ``rm_accuracy`` ...    --post-train rm: the share of pairs scored
                                                      s_w > s_l, mean chosen and rejected scores
``moe/layer{i}/...``           ``moe_layers``         MoE layer i: ``aux_loss``, ``z_loss`` (its
                                                      mean over the micro-batches),
                                                      ``dropped_fraction`` (of its assignments),
                                                      ``load_max_over_mean`` (busiest expert's
                                                      tokens / the mean), ``tokens/expert{j}``
``valid/loss``                 (log_validation)       nats/token
``valid/ppl``                  (log_validation)       ``exp(valid/loss)``
=============================  =====================  =======================================

Text: ``config`` (the run's configuration, written when the Monitor starts) and any
:meth:`Monitor.log_text` tag, shown as a preformatted block.

``metrics.jsonl``: one JSON object per line, appended and flushed per call. Every record has
``kind`` and ``wall_time`` (Unix seconds). Missing values are ``null``; NaN/inf losses are
written as Python's ``json`` writes them (``NaN``, ``Infinity``).

=======================  ==========================================================
kind ``"train"``         one per :meth:`Monitor.log_iteration`
``iteration``            int, the iteration just finished (1-based as the trainer counts)
``consumed_samples``     int, samples trained on so far
``lr``                   float, learning rate used by this iteration
``loss``                 float, nats/token, mean over every token of the global batch
``grad_norm``            float, global L2 norm of the gradient (before clipping)
``loss_scale``           float, fp16 loss scale after this iteration
``skipped_iterations``   int, iterations skipped for overflow so far
``iteration_time_s``     float, seconds per iteration
``tokens_per_s``         float, tokens per second, all devices together
``tflops_per_device``    float, achieved TFLOP/s per device (model FLOPs, flops.py)
``mfu``                  float, fraction of the device's peak, or null if unknown
``model_state_bytes``    int, bytes of model state on the logging rank
``peak_memory_bytes``    int, bytes, peak memory of the logging rank
``moe_aux_loss`` ...     MoE runs only: ``moe_aux_loss``, ``moe_z_loss`` (floats) and
                         ``moe_layers`` ({layer id: the statistics of ``model.gpt.moe_step_end``})
``mtp_loss``             --mtp-num-layers runs only: float, nats/token (``Trainer.mtp_step_end``)
``rewards_chosen`` ...   --post-train dpo only: ``rewards_chosen``, ``rewards_rejected``,
                         ``reward_accuracy``, ``reward_margin`` (floats; ``post_training.preference``)
``rm_accuracy`` ...      --post-train rm only: ``rm_accuracy``, ``rm_chosen_score``,
                         ``rm_rejected_score`` (floats; ``post_training.reward``)
kind ``"valid"``         one per :meth:`Monitor.log_validation`
``iteration``            int
``loss``                 float, nats/token on the validation split
``ppl``                  float, ``exp(loss)``
kind ``"memory"``        one per :meth:`Monitor.log_memory_breakdown` (logging rank)
``rank``                 int, global rank
``bytes``                object, name -> bytes of each part of the model state
kind ``"summary"``       one per :meth:`Monitor.summary`
``final_valid_loss``     float, nats/token; ``final_valid_ppl`` its ``exp``
``unigram_entropy``      float, nats/token; ``unigram_ppl`` its ``exp``
``loss_to_unigram``      float, ``final_valid_loss / unigram_entropy``
``sample_text``          str, the generated sample
=======================  ==========================================================
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
import time
from typing import Any, Mapping, Optional, Union

import numpy as np
import torch

from megazero.planning.flops import gpt_flops_per_iteration, mfu, peak_flops, peak_flops_for_name, throughput  # noqa: F401 (re-export)
from megazero.runtime.extras import require

#: keys accepted by :meth:`Monitor.log_iteration`, in console order.
ITERATION_KEYS = (
    "iteration",
    "consumed_samples",
    "iteration_time_s",
    "tokens_per_s",
    "tflops_per_device",
    "mfu",
    "lr",
    "loss",
    "grad_norm",
    "loss_scale",
    "skipped_iterations",
    "model_state_bytes",
    "peak_memory_bytes",
)

#: keys of a Mixture-of-Experts run, logged only when given: the step's
#: coefficient-weighted load-balancing and z-loss (added to the loss; ``model.gpt.moe_step_end``).
MOE_KEYS = ("moe_aux_loss", "moe_z_loss")
MOE_TAGS = {"moe_aux_loss": "train/moe_aux_loss", "moe_z_loss": "train/moe_z_loss"}
#: --mtp-num-layers: the step's multi-token prediction loss (added to the loss; ``Trainer.mtp_step_end``).
MTP_KEYS = ("mtp_loss",)
MOE_TAGS["mtp_loss"] = "train/mtp_loss"
#: --post-train dpo: the step's implicit-reward statistics (``megazero.post_training.preference.METRICS``).
PREFERENCE_KEYS = ("rewards_chosen", "rewards_rejected", "reward_accuracy", "reward_margin")
MOE_TAGS.update({key: f"dpo/{key}" for key in PREFERENCE_KEYS})
#: --post-train rm: the step's pair accuracy and mean scores (``megazero.post_training.reward.METRICS``).
REWARD_MODEL_KEYS = ("rm_accuracy", "rm_chosen_score", "rm_rejected_score")
MOE_TAGS.update({key: f"rm/{key.removeprefix('rm_')}" for key in REWARD_MODEL_KEYS})
#: --post-train grpo: the iteration's rollout and update statistics (``megazero.training.rl``).
RL_KEYS = (
    "rl_reward",
    "rl_response_length",
    "rl_zero_variance_fraction",
    "rl_clip_fraction",
    "rl_first_clip_fraction",
    "rl_first_ratio_deviation",
    "rl_kl",
    "rl_kl_coef",
    "rl_critic_loss",
    "rl_ptx_loss",
)
MOE_TAGS.update({key: f"rl/{key.removeprefix('rl_')}" for key in RL_KEYS})
#: per-MoE-layer routing statistics (``model.gpt.moe_step_end``'s ``moe_layers``), logged when given.
MOE_LAYERS_KEY = "moe_layers"

#: values key -> TensorBoard scalar tag.
SCALAR_TAGS = {
    "loss": "train/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "loss_scale": "train/loss_scale",
    "skipped_iterations": "train/skipped_iterations",
    "consumed_samples": "train/consumed_samples",
    "iteration_time_s": "perf/iteration_time_s",
    "tokens_per_s": "perf/tokens_per_s",
    "tflops_per_device": "perf/tflops_per_device",
    "mfu": "perf/mfu",
    "model_state_bytes": "memory/model_state_bytes",
    "peak_memory_bytes": "memory/peak_bytes",
}

_INT_KEYS = ("iteration", "consumed_samples", "skipped_iterations", "model_state_bytes", "peak_memory_bytes")
_MiB = 2**20


def _load_max_over_mean(tokens: list) -> float:
    mean = sum(tokens) / len(tokens)
    return max(tokens) / mean if mean > 0 else float("nan")


def moe_layers_summary(layers: Mapping[int, Mapping[str, Any]]) -> str:
    """The log line's compact MoE routing fields: `` | moe load max/mean: X (layer i) | moe
    dropped: Y %``: the busiest expert's tokens over the mean tokens per expert (1 = balanced,
    E = every token on one expert) of the worst layer, and the dropped assignments over all
    assignments of every layer (0 when dropless)."""
    worst = max(layers, key=lambda i: _load_max_over_mean(layers[i]["tokens_per_expert"]))
    load = _load_max_over_mean(layers[worst]["tokens_per_expert"])
    dropped = sum(v["dropped"] for v in layers.values())
    total = sum(v["assignments"] for v in layers.values())
    return f" | moe load max/mean: {load:.3f} (layer {worst}) | moe dropped: {100 * dropped / max(total, 1):.2f} %"


def moe_layer_scalars(layers: Mapping[int, Mapping[str, Any]]) -> dict[str, float]:
    """TensorBoard tags of each MoE layer's statistics (module docstring's ``moe/layer{i}/...``)."""
    out = {}
    for i, v in layers.items():
        tokens = v["tokens_per_expert"]
        out |= {
            f"moe/layer{i}/aux_loss": v["aux_loss"],
            f"moe/layer{i}/z_loss": v["z_loss"],
            f"moe/layer{i}/dropped_fraction": v["dropped"] / max(v["assignments"], 1),
            f"moe/layer{i}/load_max_over_mean": _load_max_over_mean(tokens),
        }
        out |= {f"moe/layer{i}/tokens/expert{j}": float(n) for j, n in enumerate(tokens)}
    return out


class Timer:
    """Seconds between ``start()`` and ``stop()``, accumulated over the intervals.

    On the CPU (or without a device) the clock is ``time.perf_counter``. With a CUDA
    ``device`` each interval is a pair of CUDA events recorded on the current stream, so
    starting and stopping never wait for the device: a device-wide ``torch.cuda.synchronize``
    at every step boundary (what this timer did until it stopped doing so) would also wait for the
    ZeRO-1/2 parameter all-gathers that ``--overlap-param-gather`` leaves in flight into the
    next forward, and keep the host from queueing the next step while the device works.
    ``elapsed`` / ``reset()`` read the events, waiting for the last stop event only
    (``Event.synchronize``); the training loop reads them on log steps alone. An event pair
    times the stream from the moment the device reaches ``start`` to the moment it reaches
    ``stop``: with the host ahead of the device, back-to-back steps are timed as their
    throughput; time the device idles waiting for the host counts too.
    Use as ``with Timer(device) as t: ...; t.elapsed`` or ``start()``/``stop()``.
    """

    def __init__(self, device: Union[torch.device, str, None] = None):
        device = None if device is None else torch.device(device)
        self._cuda = device is not None and device.type == "cuda"
        self._start = None  # perf_counter seconds, or a CUDA start event
        self._pending: list = []  # CUDA (start, stop) event pairs not yet added to _elapsed
        self._elapsed = self._last = 0.0

    def _mark(self):
        if not self._cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start(self) -> "Timer":
        """Start timing (no device synchronisation). Raises RuntimeError if already running."""
        if self._start is not None:
            raise RuntimeError("Timer.start() called on a running timer")
        self._start = self._mark()
        return self

    def _stop(self) -> None:
        if self._start is None:
            raise RuntimeError("Timer.stop() called on a timer that is not running")
        end, begin, self._start = self._mark(), self._start, None
        if self._cuda:
            self._pending.append((begin, end))
        else:
            self._last = end - begin
            self._elapsed += self._last

    def stop(self) -> float:
        """Stop timing; returns this interval's seconds (on CUDA reading it waits for the
        interval's stop event; ``with Timer(...)`` does not read it). Raises RuntimeError if
        not running."""
        self._stop()
        if not self._cuda:
            return self._last
        begin, end = self._pending[-1]
        end.synchronize()
        return begin.elapsed_time(end) / 1e3

    @property
    def elapsed(self) -> float:
        """Seconds summed over the completed intervals (on CUDA: waits for the last stop event)."""
        if self._pending:
            self._pending[-1][1].synchronize()  # the stream reached it: every earlier event too
            self._elapsed += sum(a.elapsed_time(b) for a, b in self._pending) / 1e3  # ms -> s
            self._pending = []
        return self._elapsed

    def reset(self) -> float:
        """Returns the accumulated seconds and sets them to zero."""
        elapsed, self._elapsed = self.elapsed, 0.0
        return elapsed

    def __enter__(self) -> "Timer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self._stop()


def memory_stats(device: Union[torch.device, str]) -> dict[str, Any]:
    """Peak memory of this process on ``device``, in bytes.

    CUDA: ``peak_bytes`` = ``torch.cuda.max_memory_allocated`` (tensors only, since start or
    the last ``torch.cuda.reset_peak_memory_stats``), plus ``allocated_bytes`` (now) and
    ``peak_reserved_bytes`` (caching allocator). Other devices: ``peak_bytes`` = the
    process's peak resident set size from ``resource.getrusage(RUSAGE_SELF).ru_maxrss``
    (KiB on Linux, converted to bytes; bytes on macOS), which includes everything the
    process holds, not only tensors. ``source`` names which one was read.
    """
    device = torch.device(device)
    if device.type == "cuda":
        return {
            "peak_bytes": int(torch.cuda.max_memory_allocated(device)),
            "allocated_bytes": int(torch.cuda.memory_allocated(device)),
            "peak_reserved_bytes": int(torch.cuda.max_memory_reserved(device)),
            "source": "cuda_max_memory_allocated",
        }
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    per_unit = 1 if sys.platform == "darwin" else 1024
    return {"peak_bytes": int(rss) * per_unit, "source": "ru_maxrss"}


def unigram_entropy(token_counts: np.ndarray) -> float:
    """Entropy in nats of the unigram distribution ``p = counts / counts.sum()``.

    ``token_counts`` has shape ``[V]`` (e.g. ``np.bincount(valid_tokens, minlength=V)``).
    ``H = -sum_i p_i ln p_i`` (zero counts contribute 0) is the cross-entropy loss of the
    best model that ignores context: the baseline a trained model must beat.
    Raises ValueError for negative counts or an all-zero array.
    """
    counts = np.asarray(token_counts, dtype=np.float64).ravel()
    if counts.size == 0 or (counts < 0).any() or counts.sum() <= 0:
        raise ValueError("token_counts must be non-negative with a positive total")
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def _plain(value: Any) -> Any:
    """A tensor / numpy scalar -> Python number; None stays None."""
    if value is None:
        return None
    if hasattr(value, "item"):
        value = value.item()
    return value


def _ppl(loss: Optional[float]) -> Optional[float]:
    if loss is None:
        return None
    return math.inf if loss > 700 else math.exp(loss)  # NaN stays NaN


def _fmt(value: Any, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def _fmt_bytes(value: Optional[int]) -> str:
    return "n/a" if value is None else f"{value / _MiB:.2f} MiB"


def format_iteration_line(values: Mapping[str, Any], train_iters: Optional[int]) -> str:
    """The console line of one iteration (see the module docstring); None -> ``n/a``."""
    v = values
    total = "" if train_iters is None else f"/{train_iters}"
    time_ms = None if v["iteration_time_s"] is None else v["iteration_time_s"] * 1e3
    mfu_pct = None if v["mfu"] is None else v["mfu"] * 100
    fields = [
        f"iteration {v['iteration']}{total}",
        f"consumed samples: {_fmt(v['consumed_samples'], 'd')}",
        f"elapsed time per iteration (ms): {_fmt(time_ms, '.1f')}",
        f"tokens/s: {_fmt(v['tokens_per_s'], '.1f')}",
        f"TFLOP/s/device: {_fmt(v['tflops_per_device'], '.3f')}",
        f"MFU: {_fmt(mfu_pct, '.2f')}{'' if mfu_pct is None else '%'}",
        f"learning rate: {_fmt(v['lr'], '.3E')}",
        f"loss: {_fmt(v['loss'], '.6E')}",
        f"grad norm: {_fmt(v['grad_norm'], '.3f')}",
        f"loss scale: {_fmt(v['loss_scale'], 'g')}",
        f"skipped iterations: {_fmt(v['skipped_iterations'], 'd')}",
        f"model state: {_fmt_bytes(v['model_state_bytes'])}",
        f"peak memory: {_fmt_bytes(v['peak_memory_bytes'])}",
    ]
    return " | ".join(fields)


def _as_code_block(text: str) -> str:
    """Indent by four spaces so TensorBoard's markdown shows the text verbatim."""
    return "\n".join("    " + line for line in text.splitlines())


def _under(run_dir: str, path: Optional[str]) -> Optional[str]:
    return None if path is None else os.path.join(run_dir, path)


class WandbLogger:
    """Weights & Biases sink for the scalars the Monitor sends to TensorBoard (same tags,
    same iteration as W&B's ``step``), the run's settings as W&B config, and the final
    summary values as the W&B run summary.

    ``wandb.init(project, name, dir=save_dir)``: with ``WANDB_MODE=offline`` (wandb's own
    variable) the run is written under ``save_dir/wandb/offline-run-*`` without a network,
    for a later ``wandb sync``. Raises MissingExtra (an ImportError, megazero.runtime.extras)
    naming the fix when wandb is missing (the config check reports it before launch; this is
    the library-level guard).
    """

    def __init__(self, project: str, name: Optional[str], save_dir: str, config: Mapping[str, Any]):
        wandb = require("wandb", "--wandb-project")
        os.makedirs(save_dir, exist_ok=True)
        self._run = wandb.init(project=project, name=name, dir=save_dir, config=dict(config))

    def log(self, tagged: Mapping[str, Any], step: int) -> None:
        """Send ``tag -> value`` at iteration ``step``; None values are left out."""
        self._run.log({tag: v for tag, v in tagged.items() if v is not None}, step=step)

    def summary(self, values: Mapping[str, Any]) -> None:
        """Set W&B run-summary values (final loss, baseline, sample)."""
        for key, value in values.items():
            self._run.summary[key] = value

    def close(self) -> None:
        """Finish the W&B run and wait for wandb's service to write everything (``teardown``:
        ``finish`` alone may return before an offline run's last records are on disk)."""
        import wandb

        self._run.finish()
        wandb.teardown()


class Monitor:
    """Console, TensorBoard and ``metrics.jsonl`` logging for one rank.

    Args: ``run_dir`` (created on the logging rank); ``tensorboard_dir`` and
    ``metrics_file``, relative to ``run_dir`` unless absolute, None to turn that output off;
    ``rank`` (global rank, used to prefix per-rank lines); ``is_logging_rank`` (only this
    rank writes anything); ``config_text`` (written as TensorBoard text ``config`` at
    start); ``train_iters`` (shown as ``iteration i/train_iters``; optional). The metrics
    file is opened for appending, so a resumed run continues it. ``wandb``: None, or a
    :class:`WandbLogger`'s arguments (``project``, ``name``, ``save_dir``, ``config``),
    which then receives every TensorBoard scalar too (logging rank only).
    """

    def __init__(
        self,
        run_dir: str,
        *,
        tensorboard_dir: Optional[str],
        metrics_file: Optional[str],
        rank: int,
        is_logging_rank: bool,
        config_text: str,
        train_iters: Optional[int] = None,
        wandb: Optional[Mapping[str, Any]] = None,
    ):
        self.rank, self.is_logging_rank, self.train_iters = rank, is_logging_rank, train_iters
        self._writer = None
        self._metrics = None
        self._wandb = None
        if not is_logging_rank:
            return
        if wandb is not None:
            self._wandb = WandbLogger(**wandb)
        os.makedirs(run_dir, exist_ok=True)
        tb_dir, metrics_path = _under(run_dir, tensorboard_dir), _under(run_dir, metrics_file)
        if tb_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=tb_dir)
        if metrics_path is not None:
            os.makedirs(os.path.dirname(metrics_path) or ".", exist_ok=True)
            self._metrics = open(metrics_path, "a", encoding="utf-8")
        self.log_text("config", config_text)

    def _record(self, kind: str, fields: Mapping[str, Any]) -> None:
        if self._metrics is not None:
            record = {"kind": kind, "wall_time": time.time(), **fields}
            record = {
                k: None if isinstance(v, float) and not math.isfinite(v) else v  # strict JSON
                for k, v in record.items()
            }
            self._metrics.write(json.dumps(record, allow_nan=False) + "\n")
            self._metrics.flush()

    def _scalars(self, tagged: Mapping[str, Any], step: int) -> None:
        if self._wandb is not None:
            self._wandb.log(tagged, step)
        if self._writer is None:
            return
        for tag, value in tagged.items():
            if value is not None:
                self._writer.add_scalar(tag, value, step)
        self._writer.flush()

    def log_iteration(self, it: int, values: Mapping[str, Any]) -> None:
        """Console line, TensorBoard scalars and a ``"train"`` record for iteration ``it``.

        ``values`` holds any of :data:`ITERATION_KEYS` (plain numbers, 0-d tensors or None;
        missing ones are ``n/a``/``null``). Raises ValueError for an unknown key or an
        ``iteration`` value different from ``it``.
        """
        extra = set(MOE_KEYS + MTP_KEYS + PREFERENCE_KEYS + REWARD_MODEL_KEYS + RL_KEYS) | {MOE_LAYERS_KEY}
        unknown = set(values) - set(ITERATION_KEYS) - extra
        if unknown:
            raise ValueError(f"unknown iteration values {sorted(unknown)}; expected keys from {ITERATION_KEYS}")
        if values.get("iteration", it) != it:
            raise ValueError(f"values['iteration']={values['iteration']} differs from it={it}")
        if not self.is_logging_rank:
            return
        record = {key: _plain(values.get(key)) for key in ITERATION_KEYS}
        record["iteration"] = it
        for key in _INT_KEYS:
            record[key] = None if record[key] is None else int(record[key])
        moe = {
            key: _plain(values[key])
            for key in MOE_KEYS + MTP_KEYS + PREFERENCE_KEYS + REWARD_MODEL_KEYS + RL_KEYS
            if key in values and values[key] is not None
        }
        line = format_iteration_line(record, self.train_iters)
        if moe:
            line += "".join(f" | {key.replace('_', ' ')}: {value:.6E}" for key, value in moe.items())
        layers = values.get(MOE_LAYERS_KEY)
        tagged = {}
        if layers:
            line += moe_layers_summary(layers)
            tagged = moe_layer_scalars(layers)
            moe[MOE_LAYERS_KEY] = {str(i): dict(v) for i, v in layers.items()}
        print(line, flush=True)
        self._scalars(
            {tag: record[key] for key, tag in SCALAR_TAGS.items()}
            | {MOE_TAGS[key]: value for key, value in moe.items() if key in MOE_TAGS}
            | tagged,
            it,
        )
        self._record("train", record | moe)

    def log_validation(self, it: int, loss: float, preference: Optional[Mapping[str, float]] = None) -> None:
        """Validation loss (nats/token) at iteration ``it``: console, ``valid/loss`` and
        ``valid/ppl`` scalars, and a ``"valid"`` record. ``preference`` (--post-train dpo): the
        validation pairs' :data:`PREFERENCE_KEYS`, printed and logged as ``valid/<key>``, in
        place of the perplexity (the loss is then the mean pair loss)."""
        if not self.is_logging_rank:
            return
        loss = _plain(loss)
        if preference is not None:
            extra = {k: _plain(v) for k, v in preference.items()}
            shown = " | ".join(f"{k.replace('_', ' ')}: {v:.6E}" for k, v in extra.items())
            print(f"validation at iteration {it} | loss: {loss:.6E} | {shown}", flush=True)
            self._scalars({"valid/loss": loss} | {f"valid/{k}": v for k, v in extra.items()}, it)
            self._record("valid", {"iteration": it, "loss": loss} | extra)
            return
        ppl = _ppl(loss)
        print(f"validation at iteration {it} | loss: {loss:.6E} | perplexity: {ppl:.4g}", flush=True)
        self._scalars({"valid/loss": loss, "valid/ppl": ppl}, it)
        self._record("valid", {"iteration": it, "loss": loss, "ppl": ppl})

    def log_rollout_validation(self, it: int, values: Mapping[str, float]) -> None:
        """--post-train grpo's held-out rollouts at iteration ``it`` (``megazero.training.rl.evaluate``:
        mean reward of sampled and greedy responses, mean response length): one console line,
        ``valid/<key>`` scalars and a ``"valid"`` record."""
        if not self.is_logging_rank:
            return
        extra = {k: _plain(v) for k, v in values.items()}
        shown = " | ".join(f"{k.replace('_', ' ')}: {v:.4f}" for k, v in extra.items())
        print(f"validation at iteration {it} | {shown}", flush=True)
        self._scalars({f"valid/{k}": v for k, v in extra.items()}, it)
        self._record("valid", {"iteration": it} | extra)

    def log_harness(self, it: int, scores: Mapping[str, Mapping[str, float]]) -> None:
        """lm-evaluation-harness scores ``{task: {metric: value}}`` at iteration ``it``: one
        console line per task, ``harness/<task>/<metric>`` scalars (standard errors only in the
        record) and a ``"harness"`` record."""
        if not self.is_logging_rank:
            return
        for task, row in scores.items():
            shown = ", ".join(f"{m} {_plain(v):.4f}" for m, v in row.items() if not m.endswith("_stderr"))
            print(f"harness at iteration {it} | {task}: {shown}", flush=True)
        self._scalars(
            {
                f"harness/{task}/{m}": _plain(v)
                for task, row in scores.items()
                for m, v in row.items()
                if not m.endswith("_stderr")
            },
            it,
        )
        finite = lambda v: v if math.isfinite(v) else None
        self._record(
            "harness",
            {
                "iteration": it,
                "scores": {t: {m: finite(_plain(v)) for m, v in row.items()} for t, row in scores.items()},
            },
        )

    def log_record(self, kind: str, fields: Mapping[str, Any]) -> None:
        """A ``kind`` record in the metrics file only (logging rank), e.g. ``"restart"``."""
        if self.is_logging_rank:
            self._record(kind, {k: _plain(v) for k, v in fields.items()})

    def log_text(self, tag: str, text: str) -> None:
        """Write ``text`` as TensorBoard text ``tag`` at step 0, preformatted."""
        if self._writer is not None:
            self._writer.add_text(tag, _as_code_block(text), 0)
            self._writer.flush()

    def log_memory_breakdown(self, breakdown: Mapping[str, int]) -> None:
        """Print this rank's model-state bytes by part (every rank, one line, rank prefix).

        ``breakdown`` maps a name (e.g. ``"params"``, ``"grads"``, ``"optimizer"``) to
        bytes; the line ends with the total. The logging rank also writes a ``"memory"``
        record.
        """
        parts = {name: int(_plain(b)) for name, b in breakdown.items()}
        body = " | ".join(f"{name} {_fmt_bytes(b)}" for name, b in parts.items())
        # one write: other ranks' lines cannot land inside this one on a shared console
        sys.stdout.write(f"[rank {self.rank}] model state: {body} | total {_fmt_bytes(sum(parts.values()))}\n")
        sys.stdout.flush()
        if self.is_logging_rank:
            self._record("memory", {"rank": self.rank, "bytes": parts})

    def log_model_state_table(self, rows: list, note: str = "") -> None:
        """Print every rank's model-state bytes as one table (logging rank only, one write).

        ``rows``: one mapping per rank (gathered by the caller), each with ``"rank"``,
        ``"bytes"`` (part name -> bytes, e.g. params, grads, optimizer, buckets) and optional
        ``"psi"`` (its parameter count), ``"formula"`` (the ZeRO formula's bytes for them,
        shown beside the total without buckets) and ``"pinned"`` (bytes of host memory
        actually page-locked, a last column when any row has it);
        ``note`` ends the header. Writes one ``"memory"`` record per rank (with
        ``pinned_bytes`` when given).
        """
        if not self.is_logging_rank:
            return
        names = list(dict.fromkeys(n for r in rows for n in r["bytes"]))
        pinned = any("pinned" in r for r in rows)
        head = ["rank", "Psi", *names, "total", "w/o buckets", "ZeRO formula"] + ["pinned"] * pinned
        table = [head]
        for r in sorted(rows, key=lambda r: r["rank"]):
            parts = {n: int(_plain(r["bytes"].get(n, 0))) for n in names}
            total = sum(parts.values())
            formula = r.get("formula")
            table.append(
                [
                    str(r["rank"]),
                    str(r.get("psi", "n/a")),
                    *(_fmt_bytes(parts[n]) for n in names),
                    _fmt_bytes(total),
                    _fmt_bytes(total - parts.get("buckets", 0)),
                    "n/a" if formula is None else _fmt_bytes(int(formula)),
                ]
                + [_fmt_bytes(int(r.get("pinned", 0)))] * pinned
            )
            record = {"rank": r["rank"], "bytes": parts}
            if "pinned" in r:
                record["pinned_bytes"] = int(r["pinned"])
            self._record("memory", record)
        widths = [max(len(row[i]) for row in table) for i in range(len(head))]
        lines = [f"model state per rank{': ' + note if note else ''}"]
        lines += ["  " + "  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in table]
        sys.stdout.write("\n".join(lines) + "\n")
        sys.stdout.flush()

    def summary(
        self,
        final_valid_loss: Optional[float],
        unigram_entropy_nats: Optional[float],
        sample_text: str,
        pair_loss: bool = False,
        rollouts: Optional[Mapping[str, float]] = None,
        rl: bool = False,
    ) -> None:
        """Print the final validation loss and perplexity beside the unigram-entropy
        baseline (nats/token, :func:`unigram_entropy`; None, printed ``n/a``, when no validation
        ran or it counted no token) and their ratio, then the sample. ``pair_loss``
        (--post-train dpo or rm): the loss is the mean preference loss of a pair, printed without
        perplexity or baseline. ``rl`` (--post-train grpo or ppo): the last held-out rollouts'
        values instead (``rollouts``, ``megazero.training.rl.evaluate``; None: no validation ran).

        Also writes TensorBoard text ``summary`` and a ``"summary"`` record.
        """
        if not self.is_logging_rank:
            return
        loss, base = _plain(final_valid_loss), _plain(unigram_entropy_nats)
        ratio = None if loss is None or base is None or base <= 0 else loss / base
        line = (
            "final held-out rollouts: "
            + (
                " | ".join(f"{k.replace('_', ' ')}: {_plain(v):.4f}" for k, v in rollouts.items())
                if rollouts
                else "n/a"
            )
            if rl
            else f"final validation loss: {_fmt(loss, '.4f')} nats/token "
            f"(perplexity {_fmt(_ppl(loss), '.2f')}) | unigram baseline: {_fmt(base, '.4f')} "
            f"nats/token (perplexity {_fmt(_ppl(base), '.2f')}) | loss / baseline: {_fmt(ratio, '.3f')}"
            if not pair_loss
            else f"final validation loss: {_fmt(loss, '.4f')} (the mean preference loss of a pair)"
        )
        print(line, flush=True)
        print(f"sample: {sample_text}", flush=True)
        self.log_text("summary", f"{line}\n\n{sample_text}")
        values = {
            "final_valid_loss": loss,
            "final_valid_ppl": _ppl(loss),
            "unigram_entropy": base,
            "unigram_ppl": _ppl(base),
            "loss_to_unigram": ratio,
            "sample_text": sample_text,
        }
        self._record("summary", values)
        if self._wandb is not None:
            self._wandb.summary(values)

    def close(self) -> None:
        """Flush and close the TensorBoard writer, the metrics file and the W&B run (idempotent)."""
        if self._wandb is not None:
            self._wandb.close()
            self._wandb = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None

    def __enter__(self) -> "Monitor":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
