from moeq.nn.experts import Activation, Llama4MoeAdapter, QuantExperts
from moeq.nn.linear import QuantLinear

__all__ = ["Activation", "Llama4MoeAdapter", "QuantExperts", "QuantLinear"]
