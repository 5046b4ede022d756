"""One queue of runs on local worker processes, for ``fmoesim-plot --run`` and
``fmoesim-reproduce --run`` (and the scoreboard's small-scale check).

The items form one queue, so a core never waits for one experiment's slowest run
before the next experiment's start; the first failure (or Ctrl-C) stops the queue as it
happens: the items not started yet never start.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

T = TypeVar("T")
R = TypeVar("R")


def run_queue(
    fn: Callable[[T], R],
    items: Sequence[T],
    jobs: int,
    on_result: Callable[[int, R], None] | None = None,
    on_error: Callable[[int, BaseException], BaseException] | None = None,
) -> list[R]:
    """``fn(item)`` for every item on ``jobs`` worker processes (in this process when
    ``jobs <= 1`` or there is one item; ``fn`` and the items must then pickle), the
    results in the items' order.  ``on_result(i, result)`` is called in this process as
    item ``i`` finishes; a failing item raises ``on_error(i, exc)`` (``exc`` itself
    without it), after the queued items are cancelled."""
    if jobs <= 1 or len(items) <= 1:
        out: list[R] = []
        for i, item in enumerate(items):
            try:
                r = fn(item)
            except Exception as exc:
                if on_error is None:
                    raise
                raise on_error(i, exc) from None
            if on_result is not None:
                on_result(i, r)
            out.append(r)
        return out
    from concurrent.futures import ProcessPoolExecutor, as_completed

    with ProcessPoolExecutor(min(jobs, len(items))) as ex:
        futures: dict[Any, int] = {ex.submit(fn, item): i for i, item in enumerate(items)}
        try:
            for f in as_completed(futures):
                i = futures[f]
                exc = f.exception()
                if exc is not None:
                    if on_error is None:
                        raise exc
                    raise on_error(i, exc) from None
                if on_result is not None:
                    on_result(i, f.result())
        except BaseException:  # a failed item or Ctrl-C: the queued items never start
            ex.shutdown(wait=True, cancel_futures=True)
            raise
    return [f.result() for f in futures]  # submitted, so keyed, in the items' order
