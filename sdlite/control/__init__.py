"""ControlNet: units as A1111's extension takes them (:mod:`.units`), preprocessors (:mod:`.preprocess`) and their
application to a sampling run (:mod:`.apply`). The network is :mod:`sdlite.models.controlnet`; its files are read by
:mod:`sdlite.weights.controlnet`."""
from .units import CONTROL_MODES, HR_OPTIONS, RESIZE_MODES, ControlError, ControlUnit

__all__ = ["ControlUnit", "ControlError", "CONTROL_MODES", "RESIZE_MODES", "HR_OPTIONS"]
