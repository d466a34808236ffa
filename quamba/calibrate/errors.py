"""The error calibration raises for bad input (data, options) or a model whose activations are
not finite."""
from quamba.errors import QuambaError


class CalibrationError(QuambaError, ValueError):
    """Calibration cannot go on; the message is one line naming the source, layer or tensor."""
