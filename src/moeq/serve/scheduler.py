"""Continuous batching for ``moeq serve``: one thread owns the model; concurrent requests share its decode steps.

Each step the scheduler (1) admits waiting requests while rows are free, (2) runs the next chunk of one admitted
prompt through the model with that request's own KV cache (chunks of :attr:`Scheduler.chunk` tokens, so a long
prompt never stalls the others for more than one chunk), merging the request into a batch once its prompt is in,
and (3) runs one decode step for every decoding row — each batch's rows together, so moeq's multi-row kernels serve
all of them in one pass over the routed experts' weights.

Batches (:mod:`moeq.serve.batch`): where the model has moeq's native decode step (every layer and the head native,
:func:`moeq.nn.engine.install`) and one step takes every row the server admits (16 with AVX512-BF16 or AMX tiles), the
batch runs on it — one C call per step instead of the model's Python forward; otherwise the model's own forward.
Either way rows are left-padded to a common width; a request joins with its prompt's cache and leaves by dropping its row. A cancelled request (a client that
went away) leaves at the next step. Models whose cache is not one full-attention layer per decoder layer (sliding
windows, linear attention) decode row by row instead, each with its own cache — same results, no batching.
"""
from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from typing import Callable

import torch

from moeq.errors import MoeqError
from moeq.serve.batch import NativeBatch, TorchBatch

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Request:
    """One completion: its prompt, settings, and where its tokens go (``emit(kind, payload)``, thread-safe)."""

    prompt: list[int]
    max_tokens: int
    emit: Callable[[str, object], None]
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False  # generate max_tokens whatever is sampled (benchmarks)
    cancelled: threading.Event = dataclasses.field(default_factory=threading.Event)
    # scheduler state
    generated: list[int] = dataclasses.field(default_factory=list)
    sampled: int = 0  # tokens sampled, the end-of-sequence token included (usage.completion_tokens)
    sent: int = 0  # characters of the decoded text already emitted
    cache: object = None  # own KV cache while the prompt runs (and, row by row, after)
    done_prompt: int = 0
    generator: torch.Generator | None = None


class Scheduler:
    def __init__(self, model, tokenizer, stop_ids: list[int], max_batch: int = 8, max_queue: int = 64,
                 chunk: int = 256, context: int | None = None):
        self.model, self.tok, self.stop_ids = model, tokenizer, set(stop_ids)
        self.max_batch, self.max_queue, self.chunk, self.context = max_batch, max_queue, chunk, context
        self.waiting: queue.Queue[Request] = queue.Queue()
        self.admitted: list[Request] = []  # prompts being prefilled
        self.alone: list[Request] = []  # decoding row by row (models whose cache cannot be left-padded)
        self.batch: NativeBatch | TorchBatch | None = None  # decoding together (made at the first join)
        self.batched: bool | None = None  # decided at the first join: False decodes row by row
        self.engine = None  # the native decode step's engine, where the model has one (decided at the first join)
        self.stats = {"steps": 0, "tokens": 0, "prompt_tokens": 0, "last_batch": 0, "max_batch": 0, "requests": 0}
        self._recent: list[tuple[float, int]] = []  # (time, tokens) of recent steps: tok/s
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="moeq-scheduler", daemon=True)
        self.error: BaseException | None = None

    # -- the API the server uses ------------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)

    def submit(self, req: Request) -> bool:
        """Queue a request; False when every row is taken and ``max_queue`` requests already wait (the caller
        answers 429)."""
        free = max(0, self.max_batch - len(self.rows) - len(self.admitted))
        if self.waiting.qsize() >= self.max_queue + free:
            return False
        if req.seed is not None:
            req.generator = torch.Generator().manual_seed(req.seed)
        self.waiting.put(req)
        self._wake.set()
        return True

    @property
    def rows(self) -> list[Request]:
        """Every decoding request (read by the server's threads too: one read of each attribute)."""
        alone, batch = self.alone, self.batch
        return alone + (batch.rows if batch is not None else [])

    def depth(self) -> dict:
        return {"waiting": self.waiting.qsize(), "prefilling": len(self.admitted), "decoding": len(self.rows)}

    def tokens_per_second(self, window: float = 10.0) -> float:
        now = time.perf_counter()
        recent = [(t, n) for t, n in self._recent if now - t <= window]
        self._recent = recent
        if len(recent) < 2:
            return 0.0
        return sum(n for _, n in recent[1:]) / max(recent[-1][0] - recent[0][0], 1e-9)

    # -- the loop ---------------------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            with torch.inference_mode():
                while not self._stop.is_set():
                    if not self._step():
                        self._wake.wait(0.05)
                        self._wake.clear()
        except BaseException as e:  # a bug in the loop itself: every request gets the error, the server reports it
            log.exception("scheduler stopped")
            self.error = e
        finally:
            for r in self.rows + self.admitted + self._drain():
                r.emit("error", "the server is shutting down" if self.error is None else
                       f"{type(self.error).__name__}: {self.error}")

    def _drain(self) -> list[Request]:
        out = []
        while True:
            try:
                out.append(self.waiting.get_nowait())
            except queue.Empty:
                return out

    def _step(self) -> bool:
        """One scheduling step; False when there was nothing to do."""
        self._drop_cancelled()
        while len(self.rows) + len(self.admitted) < self.max_batch:
            try:
                req = self.waiting.get_nowait()
            except queue.Empty:
                break
            if not req.cancelled.is_set():
                self.admitted.append(req)
                self.stats["requests"] += 1
        did = False
        if self.admitted:
            group = self._prompt_group()
            if len(group) > 1:
                try:
                    self._prefill_together(group)
                    group = []
                except Exception as e:  # nothing was changed: each prompt runs alone, so only a failing one ends
                    log.info("prompts run together failed (%s): running them one by one", e)
            for req in group:
                try:
                    self._prefill_chunk(req)
                except Exception as e:  # this prompt failed (e.g. non-finite activations): its request alone ends
                    log.warning("a prompt failed: %s", e)
                    if req in self.admitted:
                        self.admitted.remove(req)
                    req.emit("error", f"{type(e).__name__}: {e}")
            did = True
        if self.rows:
            try:
                self._decode_step()
            except Exception as e:  # the step failed: the rows in it end, the server goes on
                log.warning("a decode step failed: %s", e)
                for r in self.rows:
                    r.emit("error", f"{type(e).__name__}: {e}")
                self.alone, self.batch = [], None
            did = True
        return did

    def _drop_cancelled(self) -> None:
        for r in [r for r in self.admitted if r.cancelled.is_set()]:
            self.admitted.remove(r)
        self.alone = [r for r in self.alone if not r.cancelled.is_set()]
        gone = [i for i, r in enumerate(self.batch.rows) if r.cancelled.is_set()] if self.batch is not None else []
        if gone:
            self.batch.remove(gone)

    # -- prompts ----------------------------------------------------------------------------------------------------
    def _prompt_group(self) -> list[Request]:
        """The admitted prompts to run this step: the first alone while it is part-way through or longer than a chunk
        (chunks of its own), or before the first join has shown that caches can be left-padded; else as many whole
        prompts, in arrival order, as fit one chunk left-padded to the longest — one forward reads the experts' weights
        once for all of them."""
        first = self.admitted[0]
        if first.done_prompt or not self.batched:
            return [first]
        group, width = [], 0
        for r in self.admitted:
            w = max(width, len(r.prompt))
            if r.done_prompt or w * (len(group) + 1) > self.chunk:
                break
            group.append(r)
            width = w
        return group or [first]

    def _prefill_together(self, group: list[Request]) -> None:
        """Whole prompts through one left-padded forward (positions per row, padding masked); each request then gets
        its own rows of the cache, samples its first token and joins a batch. Changes nothing when it raises."""
        from transformers import DynamicCache  # noqa: PLC0415

        n, width = len(group), max(len(r.prompt) for r in group)
        ids = torch.zeros(n, width, dtype=torch.long)
        mask = torch.zeros(n, width, dtype=torch.long)
        for i, r in enumerate(group):
            ids[i, width - len(r.prompt):] = torch.tensor(r.prompt)
            mask[i, width - len(r.prompt):] = 1
        pos = (mask.cumsum(-1) - 1).masked_fill_(mask == 0, 1)
        cache = DynamicCache(config=self.model.config)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True,
                         logits_to_keep=1)
        if not self._layers_full(cache):
            raise MoeqError("the prompts' cache is not one full-attention layer per decoder layer")
        tokens = self._tokens(group, out.logits[:, -1])
        caches = []
        for i, r in enumerate(group):
            own, t = DynamicCache(config=self.model.config), len(r.prompt)
            for j, layer in enumerate(cache.layers):
                own.update(layer.keys[i:i + 1, :, width - t:].contiguous(),
                           layer.values[i:i + 1, :, width - t:].contiguous(), j)
            caches.append(own)
        for r, own, token in zip(group, caches, tokens):
            self.admitted.remove(r)
            r.cache, r.done_prompt = own, len(r.prompt)
            self.stats["prompt_tokens"] += len(r.prompt)
            if not self._accept(r, token):
                self._join(r)

    def _prefill_chunk(self, req: Request) -> None:
        from transformers import DynamicCache  # noqa: PLC0415

        if req.cache is None:
            req.cache = DynamicCache(config=self.model.config)
        a = req.done_prompt
        b = min(len(req.prompt), a + self.chunk)
        ids = torch.tensor([req.prompt[a:b]], dtype=torch.long)
        out = self.model(input_ids=ids, attention_mask=torch.ones(1, b, dtype=torch.long),
                         position_ids=torch.arange(a, b)[None], cache=req.cache, use_cache=True, logits_to_keep=1)
        req.done_prompt = b
        self.stats["prompt_tokens"] += b - a
        if b < len(req.prompt):
            return
        self.admitted.remove(req)
        token = self._sample(req, out.logits[0, -1])
        if self._accept(req, token):  # finished on its first token: never joins the batch
            return
        self._join(req)

    # -- the batch --------------------------------------------------------------------------------------------------
    def _layers_full(self, cache) -> bool:
        from transformers.cache_utils import DynamicLayer  # noqa: PLC0415

        layers = getattr(cache, "layers", None)
        return isinstance(layers, list) and bool(layers) and all(type(x) is DynamicLayer for x in layers)

    def _join(self, req: Request) -> None:
        t = len(req.prompt) + len(req.generated) - 1  # the last sampled token is not in the cache yet
        if self.batched is None:
            self.batched = self._layers_full(req.cache)
            if not self.batched:
                log.info("this model's cache cannot be left-padded: decoding row by row")
            else:
                from moeq.nn import engine  # noqa: PLC0415

                # one native step must hold every row the server admits: split into several steps, each would read
                # its rows' experts and the head again (a CPU whose head takes 4 rows natively: the forward wins)
                eng = engine.current(self.model)
                self.engine = eng if eng is not None and eng.max_rows() >= self.max_batch else None
                log.info("batched decode on %s", "the native decode step" if self.engine else "the model's forward")
        if not self.batched:
            self.alone.append(req)
            return
        if self.batch is None:
            self.batch = NativeBatch(self.engine, self.max_batch) if self.engine is not None else TorchBatch(self.model)
        cache, req.cache = req.cache, None
        self.batch.join(req, cache, t)

    def _decode_step(self) -> None:
        for r in list(self.alone):
            self._decode_alone(r)
        rows = self.batch.rows if self.batch is not None else []
        if not rows:
            return
        b = len(rows)
        logits = self.batch.step(torch.tensor([r.generated[-1] for r in rows], dtype=torch.long))
        tokens = self._tokens(rows, logits)
        done = [i for i, (r, t) in enumerate(zip(rows, tokens)) if self._accept(r, t)]
        self.stats["steps"] += 1
        self.stats["last_batch"] = b
        self.stats["max_batch"] = max(self.stats["max_batch"], b)
        self._recent.append((time.perf_counter(), b))
        if done:
            self.batch.remove(done)

    def _decode_alone(self, r: Request) -> None:
        t = len(r.prompt) + len(r.generated) - 1
        out = self.model(input_ids=torch.tensor([[r.generated[-1]]]), position_ids=torch.tensor([[t]]),
                         cache=r.cache, use_cache=True)
        self.stats["steps"] += 1
        self.stats["last_batch"] = 1
        self._recent.append((time.perf_counter(), 1))
        if self._accept(r, self._sample(r, out.logits[0, -1])):
            self.alone.remove(r)

    # -- tokens -----------------------------------------------------------------------------------------------------
    def _tokens(self, rows: list[Request], logits: torch.Tensor) -> list[int]:
        """Each row's next token from logits ``[B, V]``: one finiteness check and one argmax for the greedy rows."""
        if not bool(torch.isfinite(logits).all()):
            raise MoeqError("the model produced non-finite logits")
        top = logits.argmax(-1).tolist() if any(r.temperature <= 0 for r in rows) else None
        return [top[i] if r.temperature <= 0 else self._sample(r, logits[i]) for i, r in enumerate(rows)]

    def _sample(self, r: Request, logits: torch.Tensor) -> int:
        x = logits.float()
        if not bool(torch.isfinite(x).all()):
            raise MoeqError("the model produced non-finite logits")
        if r.temperature <= 0:
            return int(x.argmax())
        x = x / r.temperature
        if r.top_k > 0:
            kth = torch.topk(x, min(r.top_k, x.numel())).values[-1]
            x = x.masked_fill(x < kth, float("-inf"))
        p = torch.softmax(x, -1)
        if r.top_p < 1.0:
            sp, si = torch.sort(p, descending=True)
            cut = (sp.cumsum(-1) - sp) > r.top_p  # keep the smallest prefix reaching top_p
            sp[cut] = 0
            p = torch.zeros_like(p).scatter_(0, si, sp)
        return int(torch.multinomial(p / p.sum(), 1, generator=r.generator))

    def _accept(self, r: Request, token: int) -> bool:
        """Record a sampled token, emit the text it completes; True when the request is finished."""
        self.stats["tokens"] += 1
        r.sampled += 1
        if token in self.stop_ids and not r.ignore_eos:
            return self._finish(r, "stop")
        r.generated.append(token)
        text = self.tok.decode(r.generated, skip_special_tokens=True)
        for s in r.stop:
            at = text.find(s)
            if at >= 0:
                if at > r.sent:
                    r.emit("text", text[r.sent:at])
                r.sent = max(r.sent, at)
                return self._finish(r, "stop")
        hold = max((len(s) - 1 for s in r.stop), default=0)  # a stop string may still be completing
        ready = len(text) - hold
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for its next byte
            ready = min(ready, len(text) - 1)
        # one event per token, its visible text possibly empty (held back, or a token that decodes to nothing): a
        # streaming client sees every token arrive, as from llama.cpp's server and OpenAI's
        r.emit("text", text[r.sent:ready] if ready > r.sent else "")
        r.sent = max(r.sent, ready)
        total = len(r.prompt) + len(r.generated)
        if len(r.generated) >= r.max_tokens or (self.context is not None and total >= self.context):
            if len(text) > r.sent:
                r.emit("text", text[r.sent:])
                r.sent = len(text)
            return self._finish(r, "length")
        return False

    def _finish(self, r: Request, reason: str) -> bool:
        r.emit("done", {"finish_reason": reason, "prompt_tokens": len(r.prompt), "completion_tokens": r.sampled})
        r.cache = None
        return True

