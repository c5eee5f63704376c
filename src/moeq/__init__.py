"""moeq: calibration-free weight-only quantization and fast inference for Mixture-of-Experts models."""
__version__ = "0.1.0"
