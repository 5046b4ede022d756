"""Random eviction: the no-information baseline of MoEpic Table 1."""

from __future__ import annotations

from collections.abc import Collection

from mypy_extensions import mypyc_attr

from policies.base import Policy, PolicyContext

#: Uniform draws over the tracked keys tried before falling back to listing the candidates.
_REJECTION_TRIES = 8


@mypyc_attr(allow_interpreted_subclasses=True)
class RND(Policy):
    """Evict a candidate chosen uniformly at random.

    paper: MoEpic §2.2 / Table 1 "RND represents the method of randomly selecting cached
    experts"; its hit rates (16.41 / 33.02 / 49.69 / 67.41 / 83.15 % at 10..50 cached
    experts per layer of 60) sit within 0.8 points of C/60, which is what a random static
    set of C experts per layer gives under any routing, and what random *eviction* gives
    under uniform routing.
    here: random eviction from one global cache under the byte budget, loads on demand
    only, because the engine must load every missed expert (no bypass), so a static set
    cannot be kept; random eviction is the classic replacement-policy reading.  With one
    layer (or per-layer caches) and uniform routing its hit rate is C/60; with a global
    cache over several layers it is about 2 points lower (Qwen1.5-MoE shape, uniform
    routing: 14.0 % at C = 10, 47.8 % at C = 30), because each layer is read right after
    the other layers' misses have evicted some of its experts.

    Randomness comes only from ``ctx.rng``, so a run is reproducible from its seed.  To
    keep :meth:`victim` free of side effects (asked twice, it answers the same), the
    uniforms it needs are drawn in advance, at :meth:`reset` and after each eviction
    (:meth:`on_evict`): ``_REJECTION_TRIES`` of them index the policy's own list of
    admitted keys (whose order is a pure function of the insert/evict sequence), the
    first one that lands on a candidate wins (rejection sampling keeps the choice uniform
    over the candidates), and if none does, one more indexes the candidates listed in
    their admission order.  Cost: O(1) per hook and, usually, per victim.
    """

    name = "rnd"

    def reset(self, ctx: PolicyContext) -> None:
        """Forget all admitted keys; draw the uniforms of the first victim."""
        super().reset(ctx)
        self._keys: list[int] = []  # admitted keys; swap-remove keeps this dense
        self._pos: dict[int, int] = {}  # key -> index in self._keys
        self._buf: list[float] = []  # uniforms drawn ahead (see _draw)
        self._buf_pos = 0
        self._draw()

    #: Victims' worth of uniforms taken from the generator per call.
    draw_block: int = 256

    def _draw(self) -> None:
        """Draw the uniforms the next :meth:`victim` uses (the only use of ``ctx.rng``).

        perf: they come from a buffer refilled ``draw_block`` victims at a time, one
        generator call instead of one per eviction; the numbers are the same (a
        ``Generator``'s doubles do not depend on how the draws are chunked, and no one
        else draws from ``ctx.rng``).
        """
        n = _REJECTION_TRIES + 1
        i = self._buf_pos
        if i + n > len(self._buf):
            self._buf = self.ctx.rng.random(n * self.draw_block).tolist()
            i = 0
        self._u: list[float] = self._buf[i : i + n]
        self._buf_pos = i + n

    def on_insert(self, key: int) -> None:
        """Track a newly admitted key (O(1))."""
        if key not in self._pos:
            self._pos[key] = len(self._keys)
            self._keys.append(key)

    def on_evict(self, key: int) -> None:
        """Stop tracking ``key`` (O(1) swap-remove); draw fresh uniforms for the next victim."""
        self._draw()
        i = self._pos.pop(key, None)
        if i is None:
            return
        last = self._keys.pop()
        if i < len(self._keys):
            self._keys[i] = last
            self._pos[last] = i

    def victim(self, candidates: Collection[int], incoming: int) -> int:
        """A uniformly random member of ``candidates`` (from uniforms drawn in advance)."""
        keys, u = self._keys, self._u
        n = len(keys)
        if n:
            for j in range(_REJECTION_TRIES):
                key = keys[min(int(u[j] * n), n - 1)]
                if key in candidates:
                    return key
        pool = list(candidates)  # admission order: deterministic
        if not pool:
            raise ValueError("RND.victim called with no candidates")
        return pool[min(int(u[_REJECTION_TRIES] * len(pool)), len(pool) - 1)]
