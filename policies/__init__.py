"""Offloading policies: pure decision logic on the protocol of :mod:`policies.base`."""

from policies.base import Actions, GateView, Outcome, Policy, PolicyContext, Prefetch

__all__ = ["Actions", "GateView", "Outcome", "Policy", "PolicyContext", "Prefetch"]
