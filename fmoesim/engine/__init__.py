"""The discrete-event engine: Runner (serving loop), cache accounting, simulator backends."""

from fmoesim.engine.cache import ExpertCache
from fmoesim.engine.compute import ComputeModel
from fmoesim.engine.runner import Runner
from fmoesim.engine.serving import ServingConfig
from fmoesim.engine.simulate import RunResult, simulate

__all__ = ["ComputeModel", "ExpertCache", "RunResult", "Runner", "ServingConfig", "simulate"]
