from moeq.nn.experts import Activation, QuantExperts
from moeq.nn.linear import QuantLinear

__all__ = ["Activation", "QuantExperts", "QuantLinear"]
