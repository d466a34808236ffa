"""Calibration: the calibration set, observers, and the pass that turns them into clipping ranges."""
from quamba.calibrate.calibrate import (BACKWARD_KINDS, DEFAULT_OBSERVERS, TENSOR_KINDS, calibrate,
                                       calibrate_images)
from quamba.calibrate.data import (DEFAULT_SOURCE, DEFAULT_SPLIT, CalibrationSet, content_hash,
                                   load_calibration_set)
from quamba.calibrate.errors import CalibrationError
from quamba.calibrate.observers import (AbsMaxObserver, ObserverSpec, PercentileObserver,
                                        make_observer)

__all__ = ["calibrate", "calibrate_images", "DEFAULT_OBSERVERS", "TENSOR_KINDS", "BACKWARD_KINDS",
           "load_calibration_set", "CalibrationSet", "content_hash", "DEFAULT_SOURCE", "DEFAULT_SPLIT",
           "CalibrationError", "AbsMaxObserver", "PercentileObserver", "ObserverSpec", "make_observer"]
