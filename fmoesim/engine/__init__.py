"""The discrete-event engine: Runner (serving loop), cache accounting, SimPy backend."""

from fmoesim.engine.cache import ExpertCache
from fmoesim.engine.compute import ComputeModel
from fmoesim.engine.runner import Runner, ServingConfig
from fmoesim.engine.simulate import RunResult, simulate

__all__ = ["ComputeModel", "ExpertCache", "RunResult", "Runner", "ServingConfig", "simulate"]
