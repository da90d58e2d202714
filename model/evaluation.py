"""lm-evaluation-harness over megazero's own model: the ``MegazeroLM`` adapter and the task runner
that ``scripts/evaluate.py`` and ``train.py --eval-harness-tasks`` share.

``MegazeroLM`` is an ``lm_eval.api.model.LM`` (the harness's model interface) over a whole-model
``GPTStage`` (pp 1, any tp): every tensor-parallel rank builds one with its own partitions and
answers the same requests in the same order (the harness is deterministic), so the forward's
collectives match; each rank gets the same numbers. Its three request types behave as the
harness's Hugging Face backend (``lm_eval.models.huggingface.HFLM``, whose per-request
log-likelihoods tests/tools/test_evaluate.py compares within 1e-5):

- ``loglikelihood((context, continuation))``: trailing whitespace of the context moves to the
  start of the continuation; the continuation's tokens are those of ``encode(context +
  continuation)`` after the first ``len(encode(context))`` (so a merge across the boundary is
  scored as the tokenizer would produce it); an empty context is the prefix token (the
  tokenizer's EOD, which the ``--to-hf`` export names BOS and EOS) unless the continuation
  starts with it. The tokens ``context + continuation`` are cut from the left to the model's
  ``max_length + 1`` (its positions), the last one dropped, and the log-probabilities of the
  continuation's tokens (fp32 log-softmax over the real vocabulary, the logits gathered over
  tp, of the continuation's rows only) are summed; ``is_greedy`` is whether each is the argmax.
  Only the context is ever cut: a continuation of more than ``max_length`` tokens is refused
  (HarnessError naming the window), as the harness's ``HFLM._loglikelihood_tokens`` refuses it
  (an ``assert len(continuation_enc) <= self.max_length``; it scores no part of such a
  continuation).
- ``loglikelihood_rolling((text,))``: the whole text's log-likelihood in windows of
  ``max_length`` predictions (the harness's documented scheme): the first window predicts the
  first ``max_length`` tokens after the prefix token, each later one predicts the next
  ``max_length`` (or the rest) with the preceding tokens filling the window, so every token is
  predicted once, with as much context as fits.
- ``generate_until((context, gen_kwargs))``: KV-cache decoding (``model.sampling.forward_cached``
  and ``choose``: greedy unless ``do_sample`` with a temperature > 0), from the context's last
  ``max_length - max_gen_toks`` tokens, for at most ``max_gen_toks`` (default 256, at most
  ``max_length - 1``) tokens, stopping at EOD or once a string of ``until`` (default: the EOD
  text) appears; the text is cut before the first stop string.

lm_eval is an optional extra (``pip install -e .[eval]``): it is imported only inside the
functions here that need it (``require`` raises MissingExtra's one line otherwise), never on
the training path unless ``--eval-harness-tasks`` is given.

Tasks come from task YAML folders: ``TASKS_DIR`` (data/tasks: ``megazero_stdlib``, multiple
choice over held-out standard-library lines, and ``megazero_stdlib_ppl``, rolling
perplexity) plus any ``include`` folder, e.g. the harness's own ``lm_eval/tasks`` (README,
section "Evaluation"). Nothing is fetched over the network for the shipped tasks.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import random
from typing import Iterable, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from megazero.runtime.extras import require
from megazero.tensor_parallel.mappings import gather_from_tp_region
from model.sampling import choose, forward_cached

TASKS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "tasks")
STDERR_SUFFIX = "_stderr"


class HarnessError(ValueError):
    """A harness setting that cannot run (an unknown task name, a model it cannot score); the
    message is one line naming the flag and the fix."""


def split_names(values: Iterable[str]) -> list[str]:
    """Task names from ``["a,b", "c"]`` (comma- or space-separated flag values), in order,
    without repeats or empty names."""
    out: list[str] = []
    for v in values:
        out += [n.strip() for n in v.split(",") if n.strip() and n.strip() not in out]
    return out


def rolling_windows(tokens: Sequence[int], prefix: int, max_length: int) -> list[tuple[list[int], list[int]]]:
    """Disjoint ``(context, continuation)`` token windows that predict every token of ``tokens``
    exactly once, each scored input at most ``max_length`` tokens (the harness's
    ``loglikelihood_rolling`` scheme, see the module docstring). ``prefix`` conditions the first
    token. Example, ``max_length`` 4, tokens 0..9: ``([P], [0 1 2 3])``, ``([3], [4 5 6 7])``,
    ``([5 6 7], [8 9])``. Raises ValueError for ``max_length < 1``."""
    if max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}")
    tokens = list(tokens)
    if not tokens:
        return []
    first = min(max_length, len(tokens))
    windows = [([prefix], tokens[:first])]
    done = first
    while done < len(tokens):
        end = min(done + max_length, len(tokens))
        # the input is the max_length tokens before the last prediction; its last
        # (end - done - 1) tokens are predictions themselves, not context
        windows.append((tokens[end - max_length - 1 : done], tokens[done:end]))
        done = end
    return windows


def check_pair(i: int, n_context: int, n_continuation: int, max_length: int) -> None:
    """Raise HarnessError (one line) unless request ``i``'s ``n_context`` context tokens and
    ``n_continuation`` continuation tokens can be scored in a window of ``max_length`` positions:
    at least one of each, and the continuation whole in the window (the context may be cut).
    lm-evaluation-harness's ``HFLM._loglikelihood_tokens`` asserts the same three conditions and
    scores no part of a longer continuation, so neither does megazero."""
    if n_context < 1 or n_continuation < 1:
        raise HarnessError(
            f"request {i}: {n_context} context and {n_continuation} continuation tokens; a log-likelihood "
            "request needs at least one of each; fix: a task whose requests have a continuation"
        )
    if n_continuation > max_length:
        raise HarnessError(
            f"request {i}: its continuation is {n_continuation} tokens (after {n_context} context tokens), "
            f"longer than the model's {max_length}-token window; only the context is cut to fit, and "
            "lm-evaluation-harness's Hugging Face backend refuses such a request too (it scores a "
            f"continuation whole or not at all); fix: a task whose continuations fit in {max_length} "
            "tokens, or a model with more positions (--max-position-embeddings)"
        )


def make_lm(stage, tokenizer, what: str = "scripts/evaluate.py", **kwargs):
    """A ``MegazeroLM`` over ``stage`` (see :func:`megazero_lm_class`); raises MissingExtra
    naming ``what`` (the script or flag) without lm_eval."""
    return megazero_lm_class(what)(stage, tokenizer, **kwargs)


_CLASS = None


def megazero_lm_class(what: str = "scripts/evaluate.py"):
    """The ``MegazeroLM`` class (defined on first use, as a subclass of ``lm_eval.api.model.LM``,
    which is imported then). Raises MissingExtra naming ``what`` without lm_eval."""
    global _CLASS
    if _CLASS is not None:
        return _CLASS
    require("lm_eval", what)
    LM = require("lm_eval.api.model", what).LM

    class MegazeroLM(LM):
        """lm-evaluation-harness model over a whole-model ``GPTStage`` (pp 1, any tp).

        Args:
            stage: the model (its TP group makes every call collective over the tp ranks).
            tokenizer: a ``data.tokenizer`` object (``encode``, ``decode``, ``eod``).
            batch_size: sequences per forward (log-likelihood requests, longest first).
            max_length: the window in tokens; default the model's ``max_position_embeddings``.
            max_gen_toks: ``generate_until``'s default number of new tokens.
            seed: the generator of ``generate_until`` requests with ``do_sample``.
        """

        def __init__(
            self,
            stage,
            tokenizer,
            *,
            batch_size: int = 16,
            max_length: Optional[int] = None,
            max_gen_toks: int = 256,
            seed: int = 1234,
        ):
            super().__init__()
            if not (stage.pre_process and stage.post_process):
                raise HarnessError("the harness needs the whole model in one stage (--pp 1)")
            self.stage, self.tok = stage, tokenizer
            self.batch_size = batch_size
            self.max_length = max_length or stage.cfg.max_position_embeddings
            self.max_gen_toks, self.seed = max_gen_toks, seed
            self.vocab_size = stage.cfg.vocab_size
            self.prefix_token_id = tokenizer.eod
            self._device = next(stage.parameters()).device

        # -- tokens -> log-probabilities ---------------------------------------------------
        @torch.no_grad()
        def log_probs(self, ids: torch.Tensor, spans: Optional[Sequence[tuple[int, int, int]]] = None) -> torch.Tensor:
            """fp32 log-probabilities over the real vocabulary of the next token at every
            position of ``ids [B, T]``: ``[B, T, V]``; or, with ``spans`` ``(row, start, end)``,
            at those positions only, concatenated ``[sum(end - start), V]`` (collective over tp).
            Only the rows asked for are gathered over tp and log-softmaxed in fp32: scoring a
            continuation then holds ``n x V`` fp32 values, not ``B x T x V``."""
            stage, T = self.stage, ids.shape[1]
            if stage.sp:  # sequence parallel: T a multiple of tp (right padding is invisible)
                ids = F.pad(ids, (0, (-T) % stage.groups.tp_size))
            logits = stage(ids)[:, :T]  # (B, T, V_pad/tp)
            if spans is not None:
                logits = torch.cat([logits[b, s:e] for b, s, e in spans])  # (n, V_pad/tp)
            logits = gather_from_tp_region(logits, stage.tp)[..., : self.vocab_size]  # (..., V)
            return F.log_softmax(logits.float(), dim=-1)

        def score_tokens(self, pairs: Sequence[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
            """``(log-likelihood, is_greedy)`` of each ``(context, continuation)`` token pair
            (a non-empty context; a continuation of 1 to ``max_length`` tokens), in order; the
            context cut from the left to fit the window (module docstring). Raises HarnessError,
            before any forward, for an empty context or continuation, or a continuation longer
            than the window (which the harness's Hugging Face backend refuses too)."""
            L, out = self.max_length, [None] * len(pairs)
            for i, (ctx, cont) in enumerate(pairs):
                check_pair(i, len(ctx), len(cont), L)
            was_training = self.stage.training
            self.stage.eval()
            order = sorted(range(len(pairs)), key=lambda i: -(len(pairs[i][0]) + len(pairs[i][1])))
            try:
                for start in range(0, len(order), self.batch_size):
                    rows = []
                    for i in order[start : start + self.batch_size]:
                        ctx, cont = pairs[i]
                        window = (list(ctx) + list(cont))[-(L + 1) :]
                        rows.append((i, window[:-1], list(cont)))
                    T = max(len(inp) for _, inp, _ in rows)
                    ids = torch.tensor(
                        [inp + [0] * (T - len(inp)) for _, inp, _ in rows],  # (B, T), right-padded
                        dtype=torch.long,
                        device=self._device,
                    )
                    spans = [(b, len(inp) - len(cont), len(inp)) for b, (_, inp, cont) in enumerate(rows)]
                    logp = self.log_probs(ids, spans).split([len(cont) for _, _, cont in rows])  # (n, V) each
                    for lp, (i, inp, cont) in zip(logp, rows):
                        target = torch.tensor(cont, device=lp.device)  # (n,)
                        ll = lp.gather(1, target[:, None]).sum()
                        out[i] = (float(ll), bool((lp.argmax(dim=-1) == target).all()))
            finally:
                self.stage.train(was_training)
            return out

        def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
            """The context's and the continuation's tokens as the module docstring defines them."""
            if context == "":
                cont = self.tok.encode(continuation)
                if cont and cont[0] == self.prefix_token_id:
                    return cont[:1], cont[1:]
                return [self.prefix_token_id], cont
            stripped = context.rstrip()
            continuation = context[len(stripped) :] + continuation
            whole, ctx = self.tok.encode(stripped + continuation), self.tok.encode(stripped)
            return ctx, whole[len(ctx) :]

        # -- the harness's three request types ------------------------------------------------
        def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
            """``(log P(continuation | context), is_greedy)`` per request (module docstring)."""
            pairs = [self.encode_pair(*req.args) for req in requests]
            out = self.score_tokens(pairs)
            for req, res in zip(requests, out):
                self.cache_hook.add_partial("loglikelihood", req.args, res)
            return out

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
            """``log P(text)`` per request, summed over ``rolling_windows``."""
            windows, owner = [], []
            for r, req in enumerate(requests):
                for w in rolling_windows(self.tok.encode(req.args[0]), self.prefix_token_id, self.max_length):
                    windows.append(w)
                    owner.append(r)
            totals = [0.0] * len(requests)
            for r, (ll, _) in zip(owner, self.score_tokens(windows)):
                totals[r] += ll
            for req, res in zip(requests, totals):
                self.cache_hook.add_partial("loglikelihood_rolling", req.args, res)
            return totals

        @torch.no_grad()
        def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
            """The continuation text per request (module docstring); collective over tp."""
            out = []
            was_training = self.stage.training
            self.stage.eval()
            try:
                for req in requests:
                    out.append(self._generate(*req.args))
                    self.cache_hook.add_partial("generate_until", req.args, out[-1])
            finally:
                self.stage.train(was_training)
            return out

        def _generate(self, context: str, gen_kwargs: dict) -> str:
            kw = dict(gen_kwargs or {})
            until = kw.pop("until", None) or [self.tok.decode([self.tok.eod])]
            until = [until] if isinstance(until, str) else list(until)
            new_max = max(1, min(int(kw.pop("max_gen_toks", self.max_gen_toks)), self.max_length - 1))
            sampled = kw.get("do_sample", False) and float(kw.get("temperature", 1.0)) > 0
            temperature = float(kw.get("temperature", 1.0)) if sampled else 0.0
            generator = torch.Generator().manual_seed(self.seed)
            ids = (self.tok.encode(context) or [self.prefix_token_id])[-(self.max_length - new_max) :]
            caches: list = [None] * len(self.stage.layers)
            step = torch.tensor([ids], device=self._device)  # (1, t): the prefill
            new: list[int] = []
            for _ in range(new_max):
                logits = forward_cached(self.stage, step, caches)  # (1, V)
                token = int(
                    choose(
                        logits, temperature, int(kw.get("top_k", 0) or 0), float(kw.get("top_p", 1.0) or 1.0), generator
                    )[0]
                )
                if token == self.tok.eod:
                    break
                new.append(token)
                if any(s in self.tok.decode(new) for s in until):
                    break
                step = torch.tensor([[token]], device=self._device)  # (1, 1)
            text = self.tok.decode(new)
            for s in until:
                text = text.split(s)[0]
            return text

    _CLASS = MegazeroLM
    return _CLASS


# -- tasks -----------------------------------------------------------------------------------
def task_manager(include: Sequence[str] = (), what: str = "scripts/evaluate.py"):
    """An ``lm_eval`` TaskManager over ``TASKS_DIR`` and the ``include`` folders only (the
    package's own task index is left out: add its ``lm_eval/tasks`` folder to ``include`` for
    it). Raises MissingExtra without lm_eval; HarnessError for a folder that does not exist."""
    require("lm_eval", what)
    tasks_mod = require("lm_eval.tasks", what)
    for d in include:
        if not os.path.isdir(d):
            raise HarnessError(f"--include-path {d}: no such folder; fix: a folder of task YAML files")
    return tasks_mod.TaskManager(include_path=[TASKS_DIR, *include], include_defaults=False)


def check_tasks(
    names: Sequence[str], include: Sequence[str] = (), what: str = "scripts/evaluate.py", flag: str = "--tasks"
):
    """The TaskManager when every name in ``names`` is a task, group or tag of ``task_manager``;
    raises HarnessError naming the first unknown one, ``flag`` and the fix, or MissingExtra
    naming ``what`` without lm_eval."""
    if not names:
        raise HarnessError(f"{flag}: no task named; fix: e.g. {flag} megazero_stdlib")
    tm = task_manager(include, what)
    known = set(tm.all_tasks)
    for n in names:
        if n not in known:
            shipped = ", ".join(sorted(t for t in known if t.startswith("megazero_"))[:8])
            raise HarnessError(
                f"{flag}: unknown task {n!r} (not in {TASKS_DIR}"
                f"{' or --include-path' if include else ''}; shipped: {shipped}); fix: a task "
                "name from those folders, or --include-path DIR with its YAML file"
            )
    return tm


@contextlib.contextmanager
def _kept_rng_and_quiet_logs(quiet: bool):
    """The harness seeds python's, numpy's and torch's global generators and logs at INFO:
    leave both as they were for the caller (a training run continues its own streams). With
    ``quiet`` its progress bars (stderr) are dropped too."""
    py, npy, cpu = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    log = logging.getLogger("lm_eval")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stderr(io.StringIO()) if quiet else contextlib.nullcontext():
            yield
    finally:
        log.setLevel(level)
        random.setstate(py)
        np.random.set_state(npy)
        torch.random.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def run_tasks(
    lm,
    names: Sequence[str],
    *,
    tm=None,
    include: Sequence[str] = (),
    num_fewshot: Optional[int] = None,
    limit: Optional[float] = None,
    what: str = "scripts/evaluate.py",
    flag: str = "--tasks",
    quiet: bool = False,
) -> dict[str, dict[str, float]]:
    """Evaluate ``lm`` (an ``lm_eval`` LM) on the tasks ``names``: ``{task: {metric: value}}``,
    with ``<metric>_stderr`` beside each metric where the harness gives one; ``limit`` documents
    per task (a fraction below 1), None = all. The global RNG states are restored afterwards;
    ``quiet`` drops the harness's progress bars.
    Raises HarnessError for an unknown name, MissingExtra without lm_eval."""
    tm = tm or check_tasks(names, include, what, flag)
    evaluator = require("lm_eval.evaluator", what)
    with _kept_rng_and_quiet_logs(quiet):
        results = evaluator.simple_evaluate(
            model=lm,
            tasks=list(names),
            num_fewshot=num_fewshot,
            limit=limit,
            task_manager=tm,
            log_samples=False,
            bootstrap_iters=1000,
            verbosity=None,
        )
    scores: dict[str, dict[str, float]] = {}
    for task, values in (results or {}).get("results", {}).items():
        row = {}
        for key, v in values.items():
            metric, _, _filter = key.partition(",")
            if _filter and isinstance(v, (int, float)):
                row[metric] = float(v)
        scores[task] = row
    return scores


def format_scores(scores: dict[str, dict[str, float]]) -> list[str]:
    """One line per task: ``task: metric value (± stderr), ...`` in the harness's order."""
    lines = []
    for task, row in scores.items():
        parts = []
        for metric, v in row.items():
            if metric.endswith(STDERR_SUFFIX):
                continue
            err = row.get(metric + STDERR_SUFFIX)
            parts.append(f"{metric} {v:.4f}" + (f" (± {err:.4f})" if err is not None else ""))
        lines.append(f"{task}: " + ", ".join(parts))
    return lines
