"""Quantization formats: pure functions over the last dim, any leading dims (an expert stack is one call)."""
from moeq.formats import bnb4, int8, rtn
from moeq.formats.base import PackedWeight
from moeq.formats.bnb4 import Bnb4Weight
from moeq.formats.int8 import Int8Weight
from moeq.formats.rtn import RTNWeight

WEIGHT_TYPES: dict[str, type[PackedWeight]] = {c.format: c for c in (RTNWeight, Bnb4Weight, Int8Weight)}

__all__ = ["bnb4", "int8", "rtn", "PackedWeight", "RTNWeight", "Bnb4Weight", "Int8Weight", "WEIGHT_TYPES"]
