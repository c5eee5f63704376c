"""The rows the scheduler decodes together, two ways behind one interface (``rows``, ``join``, ``remove``, ``step``):

- :class:`NativeBatch`: moeq's native decode step (:class:`moeq.nn.engine.Engine`, one C call for every layer and the
  head, up to 16 rows) over static KV caches of ``room`` rows; for models whose layers and head all run natively.
- :class:`TorchBatch`: the model's own forward over one ``DynamicCache``; any model whose cache is one full-attention
  layer per decoder layer.

Both hold their rows left-padded to a common width ``S``: row ``b``'s ``lengths[b]`` real tokens are the columns
``S - lengths[b] .. S-1`` (masked out before that), its next token goes to column ``S`` at position ``lengths[b]``.
A request joins with its prompt's own ``DynamicCache`` (left-padding it or the batch to the wider of the two) and
leaves by dropping its row, after which the columns every row pads are trimmed.
"""
from __future__ import annotations

import torch

from moeq.errors import MoeqError


class NativeBatch:
    """Up to ``room`` rows on the native decode step. Caches ``[room, Hkv, C, D]`` per layer (keys, values) as the
    engine describes them; a join or leave moves only the used columns in place; the capacity ``C`` doubles when a
    step needs a column it lacks."""

    def __init__(self, engine, room: int):
        self.engine, self.room = engine, room
        self.rows: list = []
        self.S = 0
        self.lengths = torch.zeros(0, dtype=torch.int64)
        self.caches: list[torch.Tensor] = []
        self.mask: torch.Tensor | None = None
        self.capacity = 0

    def _describe(self, capacity: int) -> None:
        """New caches of ``capacity`` columns (the used ones copied over) and the native description for them."""
        described = self.engine.describe(self.room, capacity, capacity)
        if described is None:
            raise MoeqError(f"the native decode step declined {self.room} rows of {capacity} columns")
        m, keep, caches, state = described
        b, s = len(self.rows), self.S
        for new, old in zip(caches, self.caches):
            new[:b, :, :s].copy_(old[:b, :, :s])
        self.m, self.keep, self.caches, self.state, self.capacity = m, keep, caches, state, capacity
        self.mask = torch.zeros(self.room, capacity)

    def _mask(self) -> None:
        self.mask.zero_()
        for b, n in enumerate(self.lengths.tolist()):
            self.mask[b, :self.S - n] = float("-inf")

    def join(self, req, cache, t: int) -> None:
        """Row ``len(rows)`` := ``req``, whose ``t`` tokens are in ``cache`` (a ``DynamicCache`` of one row)."""
        width = max(self.S, t)
        if width + 1 > self.capacity:
            self._describe(_round_up(2 * (width + 1)))
        b, shift = len(self.rows), width - self.S
        for i, layer in enumerate(cache.layers):
            for j, src in enumerate((layer.keys, layer.values)):
                dst = self.caches[2 * i + j]
                if shift and b:  # the batch's rows move right: overlapping ranges, so through a copy
                    dst[:b, :, shift:width].copy_(dst[:b, :, :self.S].clone())
                    dst[:b, :, :shift].zero_()
                dst[b, :, width - t:width].copy_(src[0])
                dst[b, :, :width - t].zero_()
        self.rows.append(req)
        self.S = width
        self.lengths = torch.cat([self.lengths, torch.tensor([t])])
        self._mask()

    def remove(self, idx: list[int]) -> None:
        keep = [i for i in range(len(self.rows)) if i not in set(idx)]
        self.rows = [self.rows[i] for i in keep]
        self.lengths = self.lengths[keep]
        if not keep:
            self.S = 0
            return
        lead = int((self.S - self.lengths).min())  # columns every row pads
        width = self.S - lead
        for c in self.caches:
            c[:len(keep), :, :width].copy_(c[keep, :, lead:self.S])
        self.S = width
        self._mask()

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, V]`` of every row's next token after ``tokens`` ``[B]``."""
        if self.S + 1 > self.capacity:
            self._describe(_round_up(2 * (self.S + 1)))
            self._mask()  # a fresh mask for the new capacity
        logits = self.engine.step(self.m, tokens.contiguous(), self.lengths.clone(), self.S + 1, self.mask,
                                  self.state)
        self.S += 1
        self.lengths = self.lengths + 1
        return logits


class TorchBatch:
    """Rows through the model's own forward: one left-padded ``DynamicCache``."""

    def __init__(self, model):
        self.model = model
        self.rows: list = []
        self.cache = None
        self.mask: torch.Tensor | None = None  # [B, S] 1 = real token
        self.lengths = torch.zeros(0, dtype=torch.int64)

    def join(self, req, cache, t: int) -> None:
        if not self.rows:
            self.cache = cache
            self.mask = torch.ones(1, t, dtype=torch.long)
            self.lengths = torch.tensor([t])
            self.rows.append(req)
            return
        width = max(self.mask.shape[1], t)
        for mine, theirs in zip(self.cache.layers, cache.layers):
            mine.keys = torch.cat([_pad_left(mine.keys, width), _pad_left(theirs.keys, width)])
            mine.values = torch.cat([_pad_left(mine.values, width), _pad_left(theirs.values, width)])
        row = torch.zeros(1, width, dtype=torch.long)
        row[:, width - t:] = 1
        self.mask = torch.cat([_pad_left(self.mask, width), row])
        self.lengths = torch.cat([self.lengths, torch.tensor([t])])
        self.rows.append(req)

    def remove(self, idx: list[int]) -> None:
        keep = [i for i in range(len(self.rows)) if i not in set(idx)]
        self.rows = [self.rows[i] for i in keep]
        if not keep:
            self.cache = self.mask = None
            self.lengths = torch.zeros(0, dtype=torch.int64)
            return
        sel = torch.tensor(keep)
        self.mask = self.mask[sel]
        self.lengths = self.lengths[sel]
        lead = int((self.mask.cumsum(1) == 0).sum(1).min())  # columns every row pads
        self.mask = self.mask[:, lead:].contiguous()
        for layer in self.cache.layers:
            layer.keys = layer.keys[sel, :, lead:].contiguous()
            layer.values = layer.values[sel, :, lead:].contiguous()

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        b = len(self.rows)
        self.mask = torch.cat([self.mask, torch.ones(b, 1, dtype=torch.long)], 1)
        out = self.model(input_ids=tokens[:, None], attention_mask=self.mask, position_ids=self.lengths[:, None],
                         cache=self.cache, use_cache=True)
        self.lengths = self.lengths + 1
        return out.logits[:, -1]


def _round_up(n: int, to: int = 256) -> int:
    return -(-n // to) * to


def _pad_left(t: torch.Tensor, width: int) -> torch.Tensor:
    """``t`` (``[B, ..., S]`` for masks, ``[B, H, S, D]`` for keys/values) left-padded with zeros to ``width``."""
    dim = 1 if t.dim() == 2 else 2
    s = t.shape[dim]
    if s == width:
        return t
    shape = list(t.shape)
    shape[dim] = width - s
    return torch.cat([t.new_zeros(shape), t], dim)
