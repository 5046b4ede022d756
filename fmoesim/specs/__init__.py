"""Model and hardware specifications (typed dataclasses, also Hydra structured configs)."""

from fmoesim.specs.hardware import HardwareSpec
from fmoesim.specs.model import ModelSpec

__all__ = ["HardwareSpec", "ModelSpec"]
