"""Offloading policies: pure decision logic on the protocol of :mod:`policies.base`."""

from fmoesim._compiled import check_fresh

check_fresh()  # before a compiled policy module is imported (fmoesim/_compiled.py)

from policies.base import Actions, GateView, Outcome, Policy, PolicyContext, Prefetch  # noqa: E402

__all__ = ["Actions", "GateView", "Outcome", "Policy", "PolicyContext", "Prefetch"]
