"""ControlNet: units as A1111's extension takes them (:mod:`.units`), preprocessors (:mod:`.preprocess`) and their
application to a sampling run (:mod:`.apply`). The network is :mod:`sdlite.models.controlnet`; its files are read by
:mod:`sdlite.weights.controlnet`."""
from pathlib import Path

from .units import CONTROL_MODES, HR_OPTIONS, RESIZE_MODES, ControlError, ControlUnit

# the package's demo ControlNets (diffusers folders; ``demo-position``, for the demo model, trained by
# tools/train_demo_controlnet.py)
SHIPPED = Path(__file__).resolve().parent.parent / "data" / "controlnets"
DEMO_CONTROLNETS = ("demo-position",)

__all__ = ["ControlUnit", "ControlError", "CONTROL_MODES", "RESIZE_MODES", "HR_OPTIONS", "SHIPPED",
           "DEMO_CONTROLNETS"]
