"""Calibration: the calibration set, observers, and the pass that turns them into clipping ranges."""
from quamba.calibrate.calibrate import DEFAULT_OBSERVERS, TENSOR_KINDS, calibrate
from quamba.calibrate.data import (DEFAULT_SOURCE, DEFAULT_SPLIT, CalibrationSet, content_hash,
                                   load_calibration_set)
from quamba.calibrate.errors import CalibrationError
from quamba.calibrate.observers import (AbsMaxObserver, ObserverSpec, PercentileObserver,
                                        make_observer)

__all__ = ["calibrate", "DEFAULT_OBSERVERS", "TENSOR_KINDS", "load_calibration_set", "CalibrationSet",
           "content_hash", "DEFAULT_SOURCE", "DEFAULT_SPLIT", "CalibrationError", "AbsMaxObserver",
           "PercentileObserver", "ObserverSpec", "make_observer"]
