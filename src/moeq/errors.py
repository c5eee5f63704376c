"""moeq's own error type. Every problem moeq detects in its inputs (a checkpoint, a config, a CLI argument, a
weight to quantize) is raised as :class:`MoeqError`, naming the file, tensor, key or argument at fault. It subclasses
``ValueError``, so ``except ValueError`` keeps working; anything else escaping moeq is a bug in moeq."""
from __future__ import annotations


class MoeqError(ValueError):
    """Bad input, named: a checkpoint, tensor, metadata key, config value or argument that moeq refuses."""


class CheckpointNotFound(MoeqError, FileNotFoundError):
    """A checkpoint, shard or file that should exist does not (both a MoeqError and a FileNotFoundError)."""
