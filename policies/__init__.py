"""Offloading policies: pure decision logic on the protocol of :mod:`policies.base`."""

# Importing fmoesim first runs its check of the optional compiled build
# (fmoesim/_compiled.py), before a compiled policy module can load.
import fmoesim  # noqa: F401
from policies.base import Actions, GateView, Outcome, Policy, PolicyContext, Prefetch

__all__ = ["Actions", "GateView", "Outcome", "Policy", "PolicyContext", "Prefetch"]
