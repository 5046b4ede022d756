"""The Runner: the serving loop, written once for both backends.

It owns scheduling (static batches or online arrivals), prefill and decode iterations,
the layer loop, revealing each gate from the trace, asking the policy, classifying
accesses, admitting experts into the per-GPU caches and the metrics.  A backend
(:class:`fmoesim.engine.backend.Backend`) only executes and keeps time.

One MoE layer, in order: attention + router; sync (finished transfers become
resident); ``policy.on_gate``; every routed expert classified HIT / LATE / MISS
(``policy.on_access``) and pinned; LATE transfers escalated to on-demand priority;
MISSes admitted and loaded on demand (jumping the link's queue); then the gate's
cancellations and prefetches (so a prefetch can never evict an expert the current
layer is using, and it queues behind the on-demand loads); shared experts; then on
each GPU, resident experts compute while the missing ones load, and the layer ends
when the slowest GPU is done.

An on-demand load that finds no room waits and is tried again after each expert its GPU
computes; when nothing of the step's own is loading or left to compute and prefetches in
flight hold the budget, the Runner cancels a queued, never-started one (the one the link
would serve last) and otherwise waits for one to land; a real server must do the same
(docs/concepts.md, "Budget").
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from numbers import Integral
from typing import Any, Final

import numpy as np

from fmoesim.engine.backend import ON_DEMAND, Backend, TransferRecord
from fmoesim.engine.cache import ExpertCache
from fmoesim.engine.metrics import Metrics
from fmoesim.engine.serving import ServingConfig, static_batches
from fmoesim.errors import PolicyError
from fmoesim.specs.model import ModelSpec
from fmoesim.trace.reader import Trace
from policies.base import (
    NO_ACTIONS,
    Actions,
    BatchInfo,
    GateRows,
    GateView,
    Outcome,
    Policy,
    Prefetch,
    PrefetchBatch,
    RequestInfo,
)

# perf: Final, so the compiled build reads them as constants, not from the module's dict
_INF: Final = math.inf
_HIT: Final = Outcome.HIT
_LATE: Final = Outcome.LATE
_MISS: Final = Outcome.MISS


_PREFETCH_RULE: Final = "rule: Actions.prefetch is a sequence of Prefetch, or a PrefetchBatch"
_KEY_RULE: Final = "rule: a key is an integer"


def key_problem(key: Any, max_key: int) -> str | None:
    """Why ``key`` is no expert key of a model with ``max_key`` keys, or None."""
    if not isinstance(key, Integral):
        return f"key {key!r} is {type(key).__name__} (rule: a key is an integer in [0, {max_key}))"
    if not 0 <= int(key) < max_key:
        return f"key {key} (rule: a key is an integer in [0, {max_key}))"
    return None


def priority_problem(priority: Any) -> str | None:
    """Why ``priority`` is no prefetch priority (a finite number), or None."""
    rule = "rule: a priority is a finite number, lower going first"
    if isinstance(priority, bool) or not isinstance(priority, (int, float, np.number)):
        return f"priority {priority!r} is {type(priority).__name__} ({rule})"
    if not math.isfinite(priority):
        return f"priority {priority!r} ({rule})"
    return None


def _listed(seq: Any) -> list[Any] | None:
    """``seq``'s items as a list, or None when it cannot be iterated."""
    try:
        return list(seq)
    except TypeError:
        return None


def actions_problem(actions: Any) -> str | None:
    """The first rule of the actions' shape that ``actions`` breaks, or None: an
    :class:`Actions`; ``prefetch`` a :class:`PrefetchBatch` or a sequence of
    :class:`Prefetch` with integer keys and numeric priorities; ``cancel``, ``evict``
    and ``abort`` sequences of integers; ``budgets`` a dict or None; ``delay_s`` a
    number.  The Runner asks it when carrying actions out raised an error, to tell a
    policy's malformed actions from an error of its own; values of the right kind but
    out of range (a key beyond the model, a NaN priority) are checked where they are
    used, with their own message."""
    if not isinstance(actions, Actions):
        return (
            f"returned {type(actions).__name__}, not Actions (rule: return Actions, "
            "or NO_ACTIONS for nothing to do)"
        )
    # Any throughout: the compiled build would check each item against the annotations
    pre: Any = actions.prefetch
    pairs: list[tuple[Any, Any]]
    if isinstance(pre, PrefetchBatch):
        pairs = list(zip(pre.keys, pre.priorities, strict=False))
        what = "PrefetchBatch"
    else:
        items = _listed(pre)
        if items is None:
            return f"Actions.prefetch is {type(pre).__name__} ({_PREFETCH_RULE})"
        for i, p in enumerate(items):
            if not isinstance(p, Prefetch):
                return f"Actions.prefetch[{i}] is {type(p).__name__} ({_PREFETCH_RULE})"
        pairs = [(p.key, p.priority) for p in items]
        what = "Actions.prefetch"
    for i, (key, priority) in enumerate(pairs):
        if not isinstance(key, Integral):
            return f"{what}[{i}]: key {key!r} is {type(key).__name__} ({_KEY_RULE})"
        if isinstance(priority, bool) or not isinstance(priority, (int, float, np.number)):
            return f"{what}[{i}]: {priority_problem(priority)}"
    for field in ("cancel", "evict", "abort"):
        keys: Any = getattr(actions, field)
        listed = _listed(keys)
        if listed is None:
            return f"Actions.{field} is {type(keys).__name__} (rule: a sequence of keys)"
        for i, key in enumerate(listed):
            if not isinstance(key, Integral):
                return f"Actions.{field}[{i}]: key {key!r} is {type(key).__name__} ({_KEY_RULE})"
    budgets: Any = actions.budgets
    if budgets is not None and not isinstance(budgets, dict):
        return f"Actions.budgets is {type(budgets).__name__} (rule: a dict, or None)"
    delay: Any = actions.delay_s
    if isinstance(delay, bool) or not isinstance(delay, (int, float, np.number)):
        return f"Actions.delay_s is {type(delay).__name__} (rule: a number of seconds)"
    return None


def closed_form_applies(policy: Policy, model: ModelSpec, caches: Sequence[ExpertCache]) -> bool:
    """Whether a layer step of ``policy`` without actions and with an idle link may be
    timed in closed form (:meth:`Runner._layers_closed_form`): one GPU, one cache of
    whole experts of one size that keeps what it loads, and a policy that loads the
    routed misses only (no split experts, no whole-layer fetch) and lets resident experts
    compute while they load (not a synchronous one, whose layer waits for every transfer
    in flight, its own loads included)."""
    c = caches[0]
    return (
        len(caches) == 1
        and not policy.uses_segments
        and not policy.waits_for_prefetches()  # the closed form overlaps hits with loads
        and not policy.fetches_whole_layers()  # the closed form loads the routed misses only
        and c.group_of is None
        and not c.release_after_use  # the closed form keeps what it loads
        and model.uniform_experts  # the closed form counts free room in experts
    )


class Runner:
    """Serve ``trace`` with ``policy``; see the module docstring."""

    def __init__(
        self,
        trace: Trace,
        model: ModelSpec,
        policy: Policy,
        caches: list[ExpertCache],
        backend: Backend,
        metrics: Metrics,
        serving: ServingConfig,
        arrival_s: np.ndarray | None = None,
        access_log: bool = False,
        on_iteration: Callable[[], None] | None = None,
        served: list[int] | None = None,
        closed_form: bool = True,
        reserve_at_start: bool = False,
    ) -> None:
        self.trace, self.model, self.policy = trace, model, policy
        # engine.reserve=start: a prefetch is queued without its bytes, which its link
        # reserves when the copy starts (SimLink); one needed before then loads on demand
        self.reserve_at_start = reserve_at_start
        # the request positions served, in trace order (all of them unless some are held
        # in, see serving.split_requests); arrival_s is indexed like this list
        self.served = list(range(trace.num_requests)) if served is None else served
        self.caches, self.backend, self.metrics, self.serving = caches, backend, metrics, serving
        self.arrival_s = arrival_s
        self.on_iteration = on_iteration
        self.expert_bytes = model.expert_size_bytes
        # bytes of one expert of each layer (L,): differ where quantization does
        self.layer_bytes = model.layer_expert_bytes
        self.L, self.E, self.N = trace.num_layers, trace.num_experts, len(caches)
        # an encoder-decoder model's encoder MoE layers (the first n_enc) run at prefill
        # only; every iteration runs the decoder's, from layer n_enc on
        self.n_enc = model.encoder_layers
        self.step = 0  # global layer step (GateView.step)
        self.iteration = 0  # forward passes so far
        cls = type(policy)
        # perf: hooks a policy does not override are not called in the per-layer loop.
        self._has_gate = cls.on_gate is not Policy.on_gate
        self._has_access = cls.on_access is not Policy.on_access
        self._want_probs = policy.uses_probs and trace.probs is not None
        self._want_spec = policy.uses_spec and trace.spec_probs is not None
        self._want_req = policy.uses_request_gates
        self.segments = policy.uses_segments
        # every expert of a layer fetched when it runs (DeepSpeed-Inference), not only
        # the routed ones
        self.whole_layer = policy.fetches_whole_layers()
        if self.whole_layer and self.segments:
            raise ValueError(
                f"policy {policy.name!r}: a whole-layer fetch loads whole experts, "
                "so it cannot split them (uses_segments)"
            )
        # synchronous prefetching: a layer's experts compute only once every transfer in
        # flight on their GPU has landed (_experts_on)
        self.sync_prefetch = policy.waits_for_prefetches()
        self.n_keys = self.L * self.E
        self.max_key = 3 * self.n_keys if self.segments else self.n_keys
        self._want_req_probs = self._want_req and self._want_probs
        # python copies of per-request / per-row columns: scalar reads from lists are
        # several times cheaper than from numpy arrays in the loop.
        self._iter_start = trace.iter_start.tolist()
        self._num_tokens = trace.num_tokens.tolist()
        self._prompt = trace.prompt_tokens.tolist()
        self._output = trace.output_tokens.tolist()
        self._rid = trace.request_id.tolist()
        # perf: the routed experts of every (row, layer), flattened once, so a batch of
        # one request reads its iteration's routing with three slices.
        flat = trace.counts.reshape(-1, self.E)  # (rows * L, E)
        nz_row, self._nz_expert = np.nonzero(flat)  # (A,), (A,) row-major
        self._nz_tokens = flat[nz_row, self._nz_expert]  # (A,)
        self._nz_off = np.zeros(len(flat) + 1, dtype=np.int64)  # (rows * L + 1,)
        np.cumsum(np.bincount(nz_row, minlength=len(flat)), out=self._nz_off[1:])
        # perf: and a request in service holds its rows' routing as Python lists (experts,
        # tokens, offsets into them per (iteration, layer)): converted once per request,
        # not three tolist() calls and a numpy subtraction per iteration (2% of LRU's
        # instructions, 1% of ProMoE's; callgrind)
        self._routing: dict[int, tuple[list[int], list[int], list[int]]] = {}
        # perf: a layer with no actions that starts with an idle link is a demand-only
        # layer, timed in closed form (see _layers_closed_form); one GPU, whole experts of
        # one size (the closed form counts free room in experts).
        self._demand_ok = (
            closed_form
            and backend.closed_form_demand
            and closed_form_applies(policy, model, caches)
        )
        # a PrefetchBatch of arrays (_batch_arrays): each key's position in it, -1 for
        # keys not in it (max_key,)
        self._batch_pos = np.full(self.max_key, -1, dtype=np.int64)
        self.log: dict[str, list[Any]] | None = None
        if access_log:
            self.log = {
                k: [] for k in ("step", "iteration", "layer", "expert", "gpu", "outcome", "time_s")
            }

    def num_served(self) -> int:
        """How many requests of the trace this run serves."""
        return len(self.served)

    def run(self) -> None:
        """The whole serving loop."""
        if self.serving.mode == "online":
            self._run_online()
        else:
            self._run_static()

    # -- scheduling -------------------------------------------------------------------
    def _start_request(self, r: int, start_s: float) -> None:
        tr = self.trace
        rid = self._rid[r]
        self.metrics.request_start_s[rid] = start_s
        self.metrics.request_output_tokens[rid] = self._output[r]
        self.metrics.request_dataset[rid] = str(tr.dataset[r])
        emb = tr.embedding[self._iter_start[r]] if tr.embedding.shape[1] else None
        lo = self._iter_start[r] * self.L
        hi = lo + self._output[r] * self.L
        a, b = int(self._nz_off[lo]), int(self._nz_off[hi])
        self._routing[r] = (
            self._nz_expert[a:b].tolist(),
            self._nz_tokens[a:b].tolist(),
            (self._nz_off[lo : hi + 1] - a).tolist(),  # (output * L + 1,)
        )
        self.policy.on_request_start(RequestInfo(rid, self._prompt[r], self._output[r], emb))

    def _finish_request(self, r: int, now: float) -> None:
        del self._routing[r]
        rid = self._rid[r]
        self.metrics.request_end_s[rid] = now
        self.policy.on_request_end(rid)

    def _run_static(self) -> None:
        be, out = self.backend, self._output
        for batch in static_batches(self.served, self.serving.batch_size):
            start = be.now()
            for r in batch:
                self._start_request(r, start)
            for j in range(max(out[r] for r in batch)):
                active = [r for r in batch if out[r] > j]
                self._iteration(active, [j] * len(active), j == 0)
                now = be.now()
                for r in active:
                    if j == 0:
                        self.metrics.request_first_token_s[self._rid[r]] = now
                    if j == out[r] - 1:
                        self._finish_request(r, now)

    def _run_online(self) -> None:
        be, out, m = self.backend, self._output, self.metrics
        assert self.arrival_s is not None, "online mode needs arrival times"
        arrival = dict(zip(self.served, self.arrival_s.tolist(), strict=True))
        queue = deque(sorted(self.served, key=lambda r: (arrival[r], r)))
        running: list[int] = []
        next_j: dict[int, int] = {}
        max_b = self.serving.max_batch_size
        while queue or running:
            now = be.now()
            if not running and arrival[queue[0]] > now:
                be.idle_until(arrival[queue[0]])
                now = be.now()
            new: list[int] = []
            while queue and len(running) + len(new) < max_b and arrival[queue[0]] <= now:
                new.append(queue.popleft())
            if new:
                for r in new:
                    self._start_request(r, arrival[r])
                self._iteration(new, [0] * len(new), True)
                now = be.now()
                for r in new:
                    m.request_first_token_s[self._rid[r]] = now
                    if out[r] == 1:
                        self._finish_request(r, now)
                    else:
                        running.append(r)
                        next_j[r] = 1
                continue
            self._iteration(running, [next_j[r] for r in running], False)
            now = be.now()
            still = []
            for r in running:
                j = next_j[r]
                if j == out[r] - 1:
                    self._finish_request(r, now)
                    del next_j[r]
                else:
                    next_j[r] = j + 1
                    still.append(r)
            running = still

    # -- one iteration ----------------------------------------------------------------
    def _iteration(self, reqs: list[int], js: list[int], prefill: bool) -> None:
        tr, be, policy = self.trace, self.backend, self.policy
        rows = [self._iter_start[r] + j for r, j in zip(reqs, js, strict=True)]
        ntok = [self._num_tokens[row] for row in rows]
        tokens = sum(ntok)
        kv_tokens = pairs = 0
        n_enc = self.n_enc
        # the decoder's layers: one token per request of an encoder-decoder model
        dec_tokens, dec_kv, dec_pairs = tokens, 0, 0
        if n_enc:
            dec_tokens = len(reqs)
            for r, j in zip(reqs, js, strict=True):
                p = self._prompt[r]
                if j == 0:  # prefill: the encoder's bidirectional attention over the prompt
                    pairs += p * p
                # the decoder's token attends over its j predecessors and itself
                # (self-attention) and over the prompt's p encoder states (cross)
                dec_kv += j + p
                dec_pairs += j + 1 + p
        else:
            for r, j in zip(reqs, js, strict=True):
                p = self._prompt[r]
                if j == 0:  # prefill: causal attention over the prompt
                    pairs += p * (p + 1) // 2
                else:  # decode: one new token attends over p + j - 1 cached tokens and itself
                    kv_tokens += p + j - 1
                    pairs += p + j
            dec_kv, dec_pairs = kv_tokens, pairs
        emb = None  # (B, D)
        if tr.embedding.shape[1]:
            # perf: one request's row as a view (a slice), not a copy by fancy indexing:
            # 3% fewer instructions for LRU's whole run (callgrind)
            emb = tr.embedding[rows[0] : rows[0] + 1] if len(rows) == 1 else tr.embedding[rows]
        batch = BatchInfo(
            self.iteration, tuple(self._rid[r] for r in reqs), tuple(js), tokens, prefill, emb
        )
        t0 = be.now() if prefill else 0.0  # the prefill throughput's clock
        try:
            start_actions = policy.on_iteration_start(batch)
        except TypeError as exc:
            self._returned(exc, "on_iteration_start")
            raise
        if start_actions is not None and start_actions is not NO_ACTIONS:
            start_actions = self.checked(start_actions, "on_iteration_start")
            be.sync()  # land what finished during the previous iteration's tail
            self.apply(start_actions)
        for d in range(self.model.dense_layers):
            be.dense_layer(d, tokens, kv_tokens, pairs)
        # The routing of the whole iteration at once: per layer, the experts the batch
        # needs (union over requests) and their token counts.
        if len(rows) == 1:
            counts = tr.counts[rows[0]]  # (L, E)
            # the request's lists; offsets into them for this iteration's layers
            experts, expert_tokens, off = self._routing[reqs[0]]
            lo = js[0] * self.L
            offsets = off[lo : lo + self.L + 1]  # (L + 1,)
        else:
            counts = tr.counts[rows].sum(axis=0, dtype=np.int64)  # (L, E)
            mask = counts > 0  # (L, E)
            experts = np.nonzero(mask)[1].tolist()  # layer-major
            expert_tokens = counts[mask].tolist()
            offsets = [0, *np.cumsum(mask.sum(axis=1)).tolist()]  # (L + 1,)
        weights = probs = spec = spec_ok = spec_first = None
        # perf: one request's token-weighted means are its own rows (a weight of exactly
        # 1.0), taken without the einsum and the fancy indexing; with them, the work
        # outside the layers was 15% of ProMoE's run at batch 1 (profiled)
        single = len(rows) == 1
        if (self._want_probs or self._want_spec) and not single:
            weights = np.asarray(ntok, dtype=np.float32) / tokens  # (B,)
        if self._want_probs:
            assert tr.probs is not None
            if single:
                probs = tr.probs[rows[0]].astype(np.float32)  # (L, E)
            else:
                assert weights is not None
                probs = np.einsum("b,ble->le", weights, tr.probs[rows].astype(np.float32))
        if self._want_spec and single:
            assert tr.spec_probs is not None and tr.spec_valid is not None
            row = rows[0]
            spec_ok = tr.spec_valid[row]  # (L,)
            spec = tr.spec_probs[row].astype(np.float32)  # (L, E)
            if js[0] + 1 < self._output[reqs[0]] and tr.spec_valid[row + 1, n_enc]:
                spec_first = tr.spec_probs[row + 1, n_enc].astype(np.float32)  # (E,)
        elif self._want_spec:
            assert tr.spec_probs is not None and tr.spec_valid is not None and weights is not None
            spec_ok = tr.spec_valid[rows].all(axis=0)  # (L,)
            # the first layer of the next iteration (the decoder's first of an
            # encoder-decoder), predicted at this iteration's last layer, for the requests
            # that go on decoding
            cont = [
                row + 1 for r, j, row in zip(reqs, js, rows, strict=True) if j + 1 < self._output[r]
            ]
            if cont and tr.spec_valid[cont, n_enc].all():
                w = tr.num_tokens[cont].astype(np.float32)
                spec_first = (w / w.sum()) @ tr.spec_probs[cont, n_enc].astype(np.float32)  # (E,)
            else:
                spec_first = None
            spec = np.einsum("b,ble->le", weights, tr.spec_probs[rows].astype(np.float32))
        req_counts = tr.counts[rows] if self._want_req else None  # (B, L, E)
        req_probs = None
        if self._want_req_probs:
            assert tr.probs is not None
            req_probs = tr.probs[rows].astype(np.float32)  # (B, L, E)
        step0 = self.step
        skipped = 0 if prefill else n_enc  # layers before the first one this iteration runs
        # perf: the rows shared by the iteration's gates, each row's view and list made
        # when a policy reads it (GateRows), and the validity as Python bools (a numpy
        # bool per layer costs more)
        count_rows = GateRows(counts) if self._has_gate else None  # (L, E)
        spec_rows = None if spec is None else GateRows(spec)  # (L, E)
        spec_ok_l: list[bool] = [] if spec_ok is None else np.asarray(spec_ok).tolist()  # (L,)

        def view_of(layer: int) -> GateView:
            """The gate of ``layer`` for this batch (only for policies with ``on_gate``)."""
            spec_next = None
            spec_layer = -1  # the row of spec_rows that predicts the next layer, if valid
            if spec is not None:
                if layer + 1 < self.L:
                    if spec_ok_l[layer + 1]:
                        spec_layer = layer + 1
                else:
                    spec_next = spec_first
            return GateView(
                layer,
                None,
                tokens if layer < n_enc else dec_tokens,
                None if probs is None else probs[layer],
                spec_next,
                step0 + layer - skipped,
                None if req_counts is None else req_counts[:, layer],
                None if req_probs is None else req_probs[:, layer],
                count_rows,
                spec_rows,
                spec_layer,
            )

        gate = view_of if self._has_gate else None
        # (first layer, end, tokens, KV tokens read, attention pairs) of each run of layers:
        # every layer of a decoder-only model; an encoder-decoder's encoder at prefill only
        spans = [(n_enc, self.L, dec_tokens, dec_kv, dec_pairs)]
        if n_enc and prefill:
            spans.insert(0, (0, n_enc, tokens, kv_tokens, pairs))
        for lo, hi, tok, kv, pr in spans:
            if self._demand_ok:
                self._layers_closed_form(experts, expert_tokens, offsets, tok, kv, pr, gate, lo, hi)
                continue
            for layer in range(lo, hi):
                be.pre_gate(layer, tok, kv, pr)  # attention + router, then sync
                step = self.step
                self.step = step + 1
                actions = NO_ACTIONS if gate is None else self._on_gate(layer, gate(layer))
                o0, o1 = offsets[layer], offsets[layer + 1]
                self._layer(layer, experts[o0:o1], expert_tokens[o0:o1], tok, step, actions)
        be.lm_head(len(reqs))
        m = self.metrics
        m.iterations += 1
        if prefill:
            m.prefill_tokens += tokens
            m.prefill_s += be.now() - t0
        policy.on_iteration_end(batch)
        self.iteration += 1
        if self.on_iteration is not None:
            self.on_iteration()

    # -- one layer --------------------------------------------------------------------
    def apply(self, actions: Actions, aborted: bool = False) -> None:
        """Carry out a policy's group budgets and evictions, its cancellations and aborts
        (unless ``aborted``: a layer step stops them before its on-demand loads), then its
        prefetches, in order (held back by ``actions.delay_s``).  Actions the engine
        cannot carry out are a :class:`PolicyError` naming the hook (``on_gate`` with
        ``aborted``, else ``on_iteration_start``) and the rule: a key outside the model,
        a priority or delay that is not finite (checked where they are used), or
        actions of the wrong shape (:func:`actions_problem`, asked when carrying them
        out raised an error)."""
        try:
            self._apply(actions, aborted)
        except (AttributeError, TypeError, ValueError, IndexError) as exc:
            self._malformed(actions, "on_gate" if aborted else "on_iteration_start", exc)
            raise  # well-formed actions: the error is a hook's own, or the engine's

    def _bad(self, aborted: bool, why: str) -> None:
        """Raise :class:`PolicyError`: the actions :meth:`apply` carries out (``on_gate``'s
        with ``aborted``, else ``on_iteration_start``'s) break the rule ``why`` names."""
        hook = "on_gate" if aborted else "on_iteration_start"
        raise PolicyError(f"policy {self.policy.name!r}: {hook}: {why}")

    def _malformed(self, actions: Any, hook: str, exc: BaseException | None) -> None:
        """Raise :class:`PolicyError` (from ``exc``) if ``actions`` has the wrong shape."""
        why = actions_problem(actions)
        if why is not None:
            raise PolicyError(f"policy {self.policy.name!r}: {hook}: {why}") from exc

    def _returned(self, exc: TypeError, hook: str) -> None:
        """Raise :class:`PolicyError` (from ``exc``) if ``exc`` is the compiled build's
        check of what ``hook`` returned (``policies.base.Actions object expected; got
        None``): the interpreted build's :meth:`checked` in the compiled one's words."""
        said = str(exc)
        if said.startswith("policies.base.Actions object expected; got "):
            got = said.rsplit("got ", 1)[1].replace("None", "NoneType", 1)
            raise PolicyError(
                f"policy {self.policy.name!r}: {hook}: returned {got}, not Actions (rule: "
                "return Actions, or NO_ACTIONS for nothing to do)"
            ) from exc

    def _on_gate(self, layer: int, view: GateView) -> Actions:
        """The policy's actions at ``layer``'s gate, an :class:`Actions` (a
        :class:`PolicyError` when it returns anything else)."""
        try:
            actions = self.policy.on_gate(layer, view)
        except TypeError as exc:
            self._returned(exc, "on_gate")
            raise
        return actions if actions.__class__ is Actions else self.checked(actions, "on_gate")

    def checked(self, actions: Any, hook: str) -> Actions:
        """``actions``, returned by ``hook``, if it is an :class:`Actions` (a
        :class:`PolicyError` otherwise)."""
        if not isinstance(actions, Actions):
            self._malformed(actions, hook, None)
        return actions  # type: ignore[no-any-return]

    def _apply(self, actions: Actions, aborted: bool) -> None:
        """:meth:`apply`'s work."""
        be, caches, N, E = self.backend, self.caches, self.N, self.E
        delay = actions.delay_s
        if actions.budgets:
            if not self.segments:
                self._bad(
                    aborted,
                    "Actions.budgets without groups (rule: budgets need Policy.cache_groups)",
                )
            for cache in caches:
                for group, b in actions.budgets.items():
                    cache.set_group_budget(group, b)
        # perf: an empty field is skipped without an iterator (the fields are generic
        # sequences, so even an empty one costs a generic iteration)
        if actions.evict:
            self._evict(actions.evict)
        if actions.cancel:
            self._cancel(actions.cancel)
        if actions.abort and not aborted:
            self._cancel(actions.abort, started=True)
        prefetch = actions.prefetch
        if not prefetch:
            return
        if not -_INF < delay < _INF:  # NaN too
            self._bad(aborted, f"Actions.delay_s = {delay!r} (rule: a finite number of seconds)")
        if type(prefetch) is PrefetchBatch and N == 1:
            # perf: a re-ranking policy's batch on one GPU: two lists (or arrays), no
            # Prefetch objects
            keys = prefetch.keys
            if type(keys) is np.ndarray:
                self._batch_arrays(keys, prefetch.priorities, delay, aborted)
                return
            self._batch_ends(min(keys), max(keys), aborted)
            self._batch_loop(keys, prefetch.priorities, range(len(keys)), delay, aborted)
            return
        for p in prefetch:
            key = p.key
            if not 0 <= key < self.max_key:
                why = key_problem(key, self.max_key)
                self._bad(aborted, f"Actions.prefetch: {why}")
            g = (key % E) % N
            ent = caches[g].entries.get(key)
            if ent is not None and ent.resident:
                continue
            priority = p.priority
            if not -_INF < priority < _INF:  # NaN too: it would unsort the link's queue
                why = priority_problem(priority)
                self._bad(aborted, f"Actions.prefetch: key {key}: {why}")
            if ent is None:
                self._prefetch(g, key, priority, p.reason, delay)
            else:  # a queued prefetch takes the latest priority
                be.reprioritize_record(g, ent.record, priority)

    def _batch_ends(self, lo: Any, hi: Any, aborted: bool) -> None:
        """Check a :class:`PrefetchBatch`'s smallest and largest keys."""
        bad = [k for k in (lo, hi) if not 0 <= k < self.max_key]
        if bad:
            why = key_problem(bad[0], self.max_key)
            self._bad(aborted, f"PrefetchBatch: {why}")

    def _batch_loop(
        self,
        keys: Sequence[int],
        priorities: Sequence[float],
        positions: Iterable[int],
        delay: float,
        aborted: bool,
        skipped: np.ndarray | None = None,
    ) -> int:
        """A :class:`PrefetchBatch` on one GPU, key by key in its order (``positions``:
        each key's place in the batch): a resident key is passed over, an absent one
        loaded, a queued one re-ranked.  With ``skipped`` ``(n,)``, the positions
        passed over before the loop (:meth:`_batch_arrays`, while the cache logs its
        evictions), it stops after a load that evicted a key the batch holds at a
        skipped position further on, and returns that load's position; -1 when done."""
        cache = self.caches[0]
        get, log = cache.entries.get, cache.evicted_log
        rerank = self.backend.reprioritizer(0)
        for at, key, priority in zip(positions, keys, priorities, strict=True):
            ent = get(key)
            if ent is not None and ent.resident:
                continue
            if not -_INF < priority < _INF:  # NaN too: it would unsort the link's queue
                why = priority_problem(priority)
                self._bad(aborted, f"PrefetchBatch: key {key}: {why}")
            if ent is None:
                self._prefetch(0, key, priority, "prefetch", delay)
                if log and skipped is not None:  # it evicted: a skipped key ahead of it?
                    pos = self._batch_pos
                    for k in log:
                        p = pos[k]
                        if p > at and skipped[p]:
                            return at
                    log.clear()
            elif ent.record is not None:  # a queued prefetch takes the latest priority
                rerank(ent.record, priority)
        return -1

    def _batch_arrays(self, keys: np.ndarray, priorities: Any, delay: float, aborted: bool) -> None:
        """A :class:`PrefetchBatch` of arrays on one GPU, as :meth:`_batch_loop` takes
        the lists, with the keys resident when it arrives (most of a re-ranking) passed
        over by one array index.  A load that evicts such a key before its turn would
        make the key-by-key loop load it again then: after such a load the rest of the
        batch goes key by key (``keys`` ``(n,)`` integers, ``priorities`` ``(n,)``)."""
        if keys.ndim != 1 or keys.dtype.kind not in "iu":
            self._bad(
                aborted,
                f"PrefetchBatch: keys of dtype {keys.dtype} and shape {keys.shape} (rule: "
                "keys are a 1-D array of integers, or a list)",
            )
        self._batch_ends(int(keys.min()), int(keys.max()), aborted)
        cache, n = self.caches[0], len(keys)
        prios = np.asarray(priorities)  # (n,)
        if cache.resident_mask is None:
            cache.track_residency(self.max_key)
        skip = cache.resident_mask[keys]  # (n,) resident now
        if not skip.any():
            self._batch_loop(keys.tolist(), prios.tolist(), range(n), delay, aborted)
            return
        live = np.flatnonzero(~skip)  # (m,) positions looked at
        self._batch_pos[keys] = np.arange(n)
        cache.evicted_log = []
        try:
            at = self._batch_loop(
                keys[live].tolist(), prios[live].tolist(), live.tolist(), delay, aborted, skip
            )
        finally:
            cache.evicted_log = None
            self._batch_pos[keys] = -1
        if at >= 0:
            rest = slice(at + 1, None)
            self._batch_loop(
                keys[rest].tolist(), prios[rest].tolist(), range(at + 1, n), delay, aborted
            )

    def _prefetch(self, g: int, key: int, priority: float, reason: str, delay: float) -> None:
        """Load ``key``, absent from GPU ``g``'s cache, as a prefetch (or count it dropped
        where the cache has no room for it)."""
        cache, m = self.caches[g], self.metrics
        if key >= self.n_keys:
            size = self._size_of(g, key)
            if size == 0:
                return  # an empty segment (θ = 0 top, θ = 1 bottom)
        else:
            size = self.layer_bytes[key // self.E]
        if cache.group_of is not None:
            # perf: a full budget group with nothing evictable refuses, as admit would,
            # without the call (MoEpic's buffer while its prefetches are in flight)
            grp = cache.group_of(key)
            if (
                grp in cache.group_budget
                and not cache.group_evictable[grp]
                and cache.group_used[grp] + size > cache.group_budget[grp]
            ):
                m.prefetch_dropped += 1
                return
        # perf: a full cache with nothing evictable refuses without a call (a saturated
        # link leaves every entry in flight; dependency prefetch meets this ~5x a layer)
        full = cache.used_bytes + size > cache.budget_bytes
        if key < self.n_keys and full and not cache.evictable and not self.reserve_at_start:
            m.prefetch_dropped += 1
            return
        if not self._load(g, key, priority, reason, delay_s=delay):
            m.prefetch_dropped += 1

    def _evict(self, keys: Sequence[int]) -> None:
        """A policy's evictions: resident ones leave, queued ones are cancelled (pinned
        ones, in use by the current layer, stay)."""
        be, caches, E, N = self.backend, self.caches, self.E, self.N
        for key in keys:
            cache = caches[(key % E) % N]
            ent = cache.entries.get(key)
            if ent is None or ent.pins:
                continue
            if ent.resident:
                cache.evict(key)
            elif be.cancel((key % E) % N, key):
                cache.abort(key)

    def _cancel(self, keys: Sequence[int], started: bool = False) -> None:
        """A policy's cancellations: transfers still queued and never started are dropped;
        with ``started`` (its aborts), moving ones too, at their next chunk boundary.
        Their entries are freed at once."""
        be, caches, E, N = self.backend, self.caches, self.E, self.N
        for key in keys:
            g = (key % E) % N
            cache = caches[g]
            ent = cache.entries.get(key)
            # only a transfer nobody waits for: this layer's own loads are pinned
            if ent is None or ent.resident or ent.pins:
                continue
            if be.abort(g, key) if started else be.cancel(g, key):
                cache.abort(key)

    def _size_of(self, g: int, key: int) -> int:
        """Bytes of ``key``: a whole expert, or a segment at the policy's split ratio (a
        bottom complements the top that is cached, if one is)."""
        n = self.n_keys
        if key < n:
            return self.layer_bytes[key // self.E]
        full = key % n
        S = self.layer_bytes[full // self.E]
        if key < 2 * n:
            return round(self.policy.split_ratio(full // self.E) * S)
        top = self.caches[g].entries.get(n + full)
        if top is not None:
            return S - top.size_bytes
        return S - round(self.policy.split_ratio(full // self.E) * S)

    def _load(
        self,
        g: int,
        key: int,
        priority: float,
        reason: str,
        pin: bool = False,
        delay_s: float = 0.0,
    ) -> bool:
        """Admit ``key`` into GPU ``g``'s cache and start its transfer (pinned if ``pin``;
        not before ``delay_s``); False when the cache cannot make room."""
        cache = self.caches[g]
        size = self.layer_bytes[key // self.E] if key < self.n_keys else self._size_of(g, key)
        reserve = not (self.reserve_at_start and reason == "prefetch")
        if not cache.admit(key, size, reason, reserve):
            return False
        record = self.backend.submit(g, key, size, priority, reason, delay_s)
        ent = cache.entries.get(key)
        if ent is None:  # an idle link started it at once and found no room (refused)
            return True
        ent.record = record
        if pin:
            cache.pin(key)
        return True

    def _layer(
        self,
        layer: int,
        experts: list[int],
        expert_tokens: list[int],
        tokens: int,
        step: int,
        actions: Actions,
    ) -> None:
        """One layer step after its gate (attention and router done, the gate's
        ``actions`` known), the general path: every routed expert classified HIT / LATE
        / MISS and pinned (a queued prefetch with no bytes reserved, under
        ``engine.reserve=start``, is LATE and loads on demand instead), then
        :meth:`_finish_layer`."""
        be, caches, policy, m = self.backend, self.caches, self.policy, self.metrics
        N = self.N
        m.layer_steps += 1
        acc = m.acc[layer]
        base = layer * self.E
        log = self.log
        has_access = self._has_access
        # (gpu, key, tokens, share of the expert) of the experts (or segments) needed, by
        # what the access found
        ready: list[tuple[int, int, int, float]] = []
        pending: list[tuple[int, int, int, float]] = []
        missing: list[tuple[int, int, int, float]] = []
        cache = caches[0]
        entries = cache.entries
        multi = N > 1
        segments = self.segments
        g = 0
        # perf: the cache's and the policy's methods are called directly, not bound once
        # per layer: compiled, a direct call is a native call and a bound one a generic
        # call (hundreds of instructions more per access, counted with callgrind);
        # likewise the counters are indexed with plain ints, not the IntEnum, and the
        # lists by index (a zip with strict=True is a generic call, ~2,500 instructions)
        for i in range(len(experts)):
            e, tok = experts[i], expert_tokens[i]
            key = base + e
            if multi:
                g = e % N
                cache = caches[g]
                entries = cache.entries
            ent = entries.get(key)
            if segments and ent is None:
                outcome = self._access_parts(g, layer, key, tok, ready, pending, missing)
                acc[int(outcome)] += 1
            elif ent is None:
                outcome = _MISS
                missing.append((g, key, tok, 1.0))
                acc[2] += 1
            elif ent.resident:
                cache.pin(key, ent)
                outcome = _HIT
                ready.append((g, key, tok, 1.0))
                acc[0] += 1
            elif ent.reserved:
                cache.pin(key, ent)
                outcome = _LATE
                pending.append((g, key, tok, 1.0))
                acc[1] += 1
                be.escalate(g, key)  # an in-flight prefetch needed now jumps the queue
            else:  # queued with no bytes reserved (engine.reserve=start): loaded on demand
                outcome = _LATE  # in its place, as MoE-Infinity's public code replaces it
                self._cancel([key])
                missing.append((g, key, tok, 1.0))
                acc[1] += 1
            if has_access:
                policy.on_access(key, outcome)
            if log is not None:
                self._log_access(step, layer, e, g, outcome, be.now())
        if self.whole_layer:
            self._add_unrouted(layer, experts, missing)
        self._finish_layer(layer, ready, pending, missing, tokens, actions)

    def _add_unrouted(
        self, layer: int, experts: list[int], missing: list[tuple[int, int, int, float]]
    ) -> None:
        """A whole-layer fetch (:meth:`Policy.fetches_whole_layers`): the experts of
        ``layer`` the gate did not route to and no cache holds join ``missing`` with no
        tokens (loaded and waited for, never computed, never an access), and the layer's
        loads go in expert order, as a fetch that does not know the routing issues them."""
        caches, N, E = self.caches, self.N, self.E
        base = layer * E
        routed = set(experts)
        for e in range(E):
            g = e % N if N > 1 else 0
            if e not in routed and base + e not in caches[g].entries:
                missing.append((g, base + e, 0, 1.0))
        missing.sort(key=lambda x: x[1])

    def _finish_layer(
        self,
        layer: int,
        ready: list[tuple[int, int, int, float]],
        pending: list[tuple[int, int, int, float]],
        missing: list[tuple[int, int, int, float]],
        tokens: int,
        actions: Actions,
    ) -> None:
        """The rest of a layer once its accesses are classified (hits and in-flight
        experts pinned): on-demand loads, the gate's actions, shared experts, then each
        GPU's expert phase."""
        m, N, be = self.metrics, self.N, self.backend
        deferred: list[tuple[int, int, int, float]] = []
        if actions.abort:  # the router's result stops wrong prefetches before misses load
            try:
                self._cancel(actions.abort, started=True)
            except (AttributeError, TypeError, ValueError, IndexError) as exc:
                self._malformed(actions, "on_gate", exc)
                raise  # well-formed actions: the error is a hook's own, or the engine's
        for x in missing:  # on-demand loads jump the link's queue
            if self._load(x[0], x[1], ON_DEMAND, "on_demand", pin=True):
                pending.append(x)
            elif x[2]:
                deferred.append(x)
            # else: a whole-layer fetch's unrouted expert finds no room: nothing needs it
        if actions is not NO_ACTIONS:  # after the layer's own experts are pinned and loading
            self.apply(actions, aborted=True)
        be.begin_experts(layer, tokens)  # shared experts, then each GPU's expert phase
        if N == 1:
            self._experts_on(0, ready, pending, deferred, layer)
        else:
            for g in range(N):
                self._experts_on(
                    g,
                    [x for x in ready if x[0] == g],
                    [x for x in pending if x[0] == g],
                    [x for x in deferred if x[0] == g],
                    layer,
                )
        stall = be.end_experts()
        if stall:
            m.stall_s += stall
            m.stall_layer_s[layer] += stall

    def _log_access(
        self, step: int, layer: int, expert: int, gpu: int, outcome: Outcome, time_s: float
    ) -> None:
        """One row of the access log (only called when ``access_log`` is on)."""
        log = self.log
        assert log is not None
        # one append per column, not a loop over a tuple of mixed ints and a float: the
        # compiled build would type such a tuple's items as floats
        log["step"].append(step)
        log["iteration"].append(self.iteration)
        log["layer"].append(layer)
        log["expert"].append(expert)
        log["gpu"].append(gpu)
        log["outcome"].append(int(outcome))
        log["time_s"].append(time_s)

    def _layers_closed_form(
        self,
        experts: list[int],
        expert_tokens: list[int],
        offsets: list[int],
        tokens: int,
        kv_tokens: int,
        pairs: int,
        gate: Callable[[int], GateView] | None,
        lo: int,
        hi: int,
    ) -> None:
        """The layer loop of one iteration's layers ``lo`` to ``hi - 1`` on a backend with
        ``closed_form_demand`` (the simulator, one GPU, whole experts).

        A layer step whose gate asks for nothing and whose link is idle is a demand-only
        step: every cached expert is resident, so an access is a HIT or a MISS, and the
        misses load on demand one after another while the hits compute.  Such a step is
        timed here in closed form, on the backend's clock, without driving the link's
        event loop; any other step goes through :meth:`_layer`.  It does exactly what
        the general path does (same policy calls in the same order, same candidates for
        every victim, same transfer records and clock, to the last bit:
        ``tests/test_engine_demand.py``).  When a step's misses might not all fit next
        to its pinned hits it hands the rest of that step to :meth:`_finish_layer`.

        perf: one loop over the layers with the clock in local variables, instead of
        several calls per layer step into the backend (attention, idle check, the
        layer's closed form); the demand-only caches spend every layer step here, and
        this loop made them 1.1-1.9x faster than those per-step calls (README Speed).
        """
        be, m, cache, policy = self.backend, self.metrics, self.caches[0], self.policy
        timing = be.demand_timing(tokens, kv_tokens, pairs)
        pre_s, shared_s = timing.pre_s, timing.shared_s
        a, b = timing.expert_a_s, timing.expert_b_s
        size = self.expert_bytes
        E = self.E
        entries = cache.entries
        ev = cache.evictable
        has_access = self._has_access  # perf: direct calls, see _layer
        log = self.log
        acc_all = m.acc
        idle = be.link_idle(0)
        t, busy_c = be.clock_s, be.busy_compute_s
        closed = 0  # layer steps timed here
        for layer in range(lo, hi):
            if idle:  # attention + router; nothing can land, so no sync
                t += pre_s
                busy_c += pre_s
            else:
                be.clock_s, be.busy_compute_s = t, busy_c
                be.pre_gate(layer, tokens, kv_tokens, pairs)
                t, busy_c = be.clock_s, be.busy_compute_s
                idle = be.link_idle(0)
            step = self.step
            self.step = step + 1
            o0, o1 = offsets[layer], offsets[layer + 1]
            actions = NO_ACTIONS
            if gate is not None:
                actions = self._on_gate(layer, gate(layer))
                if actions is not NO_ACTIONS:
                    idle = False
            if not idle:  # the general path, on the backend's clock
                be.clock_s, be.busy_compute_s = t, busy_c
                self._layer(layer, experts[o0:o1], expert_tokens[o0:o1], tokens, step, actions)
                t, busy_c = be.clock_s, be.busy_compute_s
                idle = be.link_idle(0)
                continue
            m.layer_steps += 1
            acc = acc_all[layer]
            base = layer * E
            hit_keys: list[int] = []
            hit_tok = 0  # tokens of the hits
            miss_keys: list[int] = []
            miss_tok: list[int] = []
            for i in range(o0, o1):
                key = base + experts[i]
                ent = entries.get(key)
                if ent is None:
                    outcome = _MISS
                    miss_keys.append(key)
                    miss_tok.append(expert_tokens[i])
                else:
                    outcome = _HIT  # an idle link leaves nothing in flight
                    hit_keys.append(key)
                    hit_tok += expert_tokens[i]
                    if not ent.used:  # what pin() records; pins matter only if a miss admits
                        ent.used = True
                        if ent.record is not None:
                            ent.record.used = True
                if has_access:
                    policy.on_access(key, outcome)
                if log is not None:
                    self._log_access(step, layer, experts[i], 0, outcome, t)
            acc[0] += len(hit_keys)  # perf: plain ints, not the IntEnum, as list indices
            records: list[TransferRecord] = []
            if miss_keys:
                acc[2] += len(miss_keys)
                for key in hit_keys:  # the victims of the misses' admissions skip them
                    cache.pin(key)
                free = cache.budget_bytes - cache.used_bytes + size * len(ev)
                if size > cache.budget_bytes or free < size * len(miss_keys):
                    # some miss may not find room: the general path defers and reclaims
                    be.clock_s, be.busy_compute_s = t, busy_c
                    hits = set(hit_keys)
                    self._finish_layer(
                        layer,
                        [
                            (0, base + experts[i], expert_tokens[i], 1.0)
                            for i in range(o0, o1)
                            if base + experts[i] in hits
                        ],
                        [],
                        [(0, k, tok, 1.0) for k, tok in zip(miss_keys, miss_tok, strict=True)],
                        tokens,
                        NO_ACTIONS,
                    )
                    t, busy_c = be.clock_s, be.busy_compute_s
                    idle = be.link_idle(0)
                    continue
                for key in miss_keys:
                    if not cache.admit(key, size, "on_demand"):  # pragma: no cover - checked
                        raise RuntimeError(f"expert {key} found no room after the room check")
                records = be.demand_loads(miss_keys, size, t)  # loading from now on
            closed += 1
            if shared_s is not None:
                t += shared_s
                busy_c += shared_s
            if hit_keys:  # the resident experts compute as one block
                d = len(hit_keys) * a + b * hit_tok
                t += d
                busy_c += d
            if not miss_keys:
                for key in hit_keys:  # pinned and released: to the end of the candidates' order
                    del ev[key]
                    ev[key] = None
                continue
            stall = 0.0
            for i in range(len(records)):  # perf: by index, see _layer
                rec, tok = records[i], miss_tok[i]
                if rec.end_s > t:  # the miss's load has not landed: the GPU waits
                    stall += rec.end_s - t
                    t = rec.end_s
                d = 1.0 * (a + b * tok)
                t += d
                busy_c += d
            # the order the general path frees them in: the hits after they compute, then
            # each miss as it lands (policies may read the candidates' order)
            for key in hit_keys:
                cache.unpin(key)
            for i in range(len(records)):
                key, rec = miss_keys[i], records[i]
                ent = entries[key]
                ent.record = rec
                ent.used = rec.used = True
                cache.complete(key)
            if stall:
                m.stall_s += stall
                m.stall_layer_s[layer] += stall
        be.clock_s, be.busy_compute_s = t, busy_c
        be.closed_form_steps += closed

    def _split_whole(self, g: int, layer: int, key: int) -> bool:
        """A whole expert prefetched into the buffer has been used: like a missed one,
        its top joins its layer's cache (evicting the policy's victim there) and its
        bottom stays in the buffer (MoEpic §3.3: "replaces it with the newly loaded
        expert"); False when the layer caches no tops, the top is already cached, the
        expert is still in use or gone (caching off releases it after use), or there is
        no room."""
        n, S = self.n_keys, self.layer_bytes[layer]
        cache = self.caches[g]
        tb = round(self.policy.split_ratio(layer) * S)
        if tb <= 0 or tb > cache.group_budget.get(layer, 0) or n + key in cache.entries:
            return False
        if key not in cache.entries:
            return False
        bottom = 2 * n + key if tb < S else None
        if not cache.split(key, n + key, tb, bottom):
            return False
        self.backend.split(g, key, [n + key] if bottom is None else [n + key, bottom])
        return True

    def _access_parts(
        self,
        g: int,
        layer: int,
        key: int,
        tok: int,
        ready: list[tuple[int, int, int, float]],
        pending: list[tuple[int, int, int, float]],
        missing: list[tuple[int, int, int, float]],
    ) -> Outcome:
        """A split-expert access to ``key``, not held whole: its top and bottom segments
        (or, with no top and no room for one, the whole expert) sorted into ready /
        pending / missing; HIT only if every part is resident."""
        n, S = self.n_keys, self.layer_bytes[layer]
        cache = self.caches[g]
        top = cache.entries.get(n + key)
        parts: list[tuple[int, float]]
        if top is not None:
            f = top.size_bytes / S
            parts = [(n + key, f)] if f >= 1.0 else [(n + key, f), (2 * n + key, 1.0 - f)]
        else:
            tb = round(self.policy.split_ratio(layer) * S)
            if 0 < tb <= cache.group_budget.get(layer, 0):  # the miss's top joins the cache
                f = tb / S
                parts = [(n + key, f)] if tb >= S else [(n + key, f), (2 * n + key, 1.0 - f)]
            else:
                parts = [(key, 1.0)]
        outcome = _HIT
        for pk, f in parts:
            ent = cache.entries.get(pk)
            if ent is None:
                missing.append((g, pk, tok, f))
                outcome = _MISS
                continue
            cache.pin(pk)
            if ent.resident:
                ready.append((g, pk, tok, f))
            else:
                pending.append((g, pk, tok, f))
                self.backend.escalate(g, pk)
                if outcome is _HIT:
                    outcome = _LATE
        return outcome

    def _reclaim(self, g: int) -> bool:
        """An on-demand load finds GPU ``g``'s budget held by unused prefetches in
        flight: cancel the queued, never-started one the link would serve last (the
        largest current queue priority value, ties: the latest submitted, by the link's
        sequence numbers; the hit-rate-only ``next_step`` backend numbers none, so its
        ties go to the largest key); if none can be cancelled, wait for one to land (it
        then becomes evictable).  False when nothing is in flight."""
        cache, be = self.caches[g], self.backend
        inflight = [
            (e.record.link_priority, e.record.seq, k)
            for k, e in cache.entries.items()
            if not e.resident and not e.pins and e.record is not None and e.reserved
        ]
        if not inflight:
            return False
        for _, _, key in sorted(inflight, reverse=True):
            if be.cancel(g, key):  # one at a time: the caller retries its admissions
                cache.abort(key)
                return True
        be.wait_any(g, [k for _, _, k in inflight])
        return True

    def _experts_on(
        self,
        g: int,
        ready: list[tuple[int, int, int, float]],
        pending: list[tuple[int, int, int, float]],
        deferred: list[tuple[int, int, int, float]],
        layer: int,
    ) -> None:
        """GPU ``g``'s expert phase: resident experts (and segments) compute while the
        others load."""
        be, cache = self.backend, self.caches[g]
        if self.sync_prefetch:
            # synchronous prefetching: no expert computes before every transfer in flight
            # on this GPU (the gate's prefetches, the layer's own loads) has landed
            flying = [k for k, e in cache.entries.items() if not e.resident]
            while flying:
                flying.remove(be.wait_any(g, flying))
        if ready:
            be.experts(
                g,
                [x[2] for x in ready],
                [x[3] for x in ready] if self.segments else None,
                [x[1] for x in ready],
            )
            for x in ready:
                cache.unpin(x[1])
                if self.segments and x[1] < self.n_keys:
                    self._split_whole(g, layer, x[1])
        while pending or deferred:
            if deferred:  # room may have been freed by experts computed since
                be.catch_up(g)  # and prefetches landed by now are evictable
                still = []
                for x in deferred:
                    ent = cache.entries.get(x[1])
                    if ent is not None and not ent.reserved:  # prefetched since, not started
                        self._cancel([x[1]])
                        ent = None
                    if ent is not None:  # the gate's actions prefetched it since: wait for it
                        cache.pin(x[1], ent)
                        if not ent.resident:
                            be.escalate(g, x[1])
                        pending.append(x)
                    elif self._load(g, x[1], ON_DEMAND, "on_demand", pin=True):
                        pending.append(x)
                    else:
                        still.append(x)
                deferred = still
            if not pending:
                if self._reclaim(g):
                    continue
                raise RuntimeError(
                    f"layer {layer}: GPU {g}'s expert budget cannot hold the experts "
                    "this layer needs"
                )
            if len(pending) == 1:
                x = pending.pop()
                be.wait_any(g, [x[1]])
            else:
                keys = [x[1] for x in pending]  # distinct: one entry per expert or segment
                x = pending.pop(keys.index(be.wait_any(g, keys)))
            if x[2]:  # an unrouted expert of a whole-layer fetch computes nothing
                be.expert(g, x[1], x[2], x[3])
            cache.unpin(x[1])
            if self.segments and x[1] < self.n_keys:
                self._split_whole(g, layer, x[1])
