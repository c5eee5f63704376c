"""moeq: calibration-free weight-only quantization and fast inference for Mixture-of-Experts models."""
from moeq.version import __version__

from moeq.api import inspect, quantize_, save, set_activations  # noqa: E402
from moeq.errors import MoeqError  # noqa: E402
from moeq.config import BNB4, FP4, NF4, RTN, Int8, Keep, QuantConfig, method  # noqa: E402
from moeq.loader import load  # noqa: E402
from moeq.rotate import rotate_  # noqa: E402

__all__ = ["quantize_", "rotate_", "load", "save", "inspect", "set_activations", "QuantConfig", "RTN", "BNB4", "NF4", "FP4", "Int8", "Keep",
           "method", "MoeqError", "__version__"]
