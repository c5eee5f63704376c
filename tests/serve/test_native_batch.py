"""The scheduler's native batch (moeq.serve.batch.NativeBatch: the native decode step over static caches, rows
joining and leaving between steps) against the model's own forward (TorchBatch, the path every other model takes):
the same greedy tokens and logits within bf16 rounding at every step, through joins that widen the batch, leaves
that trim it, capacity growth, and two batches beside each other."""
import pytest
import torch

from moeq import native

pytestmark = pytest.mark.skipif(native.lib() is None or not native.has_simd(),
                                reason="the native decode step needs the SIMD build")


def _prompt(m, ids: list[int]):
    from transformers import DynamicCache

    c = DynamicCache(config=m.config)
    out = m(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), cache=c,
            use_cache=True, logits_to_keep=1)
    return c, int(out.logits[0, -1].float().argmax())


class Row:  # what the batches need of a request
    def __init__(self, name):
        self.name = name
        self.generated = []


def test_native_batch_follows_the_model_through_joins_and_leaves(tiny_model):
    from moeq.nn import decode, engine
    from moeq.serve import loader
    from moeq.serve.batch import NativeBatch, TorchBatch

    m, _, _, _ = loader(str(tiny_model), quant="q4_0", batch=8)()
    eng = engine.current(m)
    assert eng is not None and eng.max_rows() >= 4
    g = torch.Generator().manual_seed(0)
    vocab = m.config.vocab_size
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (5, 40, 3, 300, 17)]
    nat, ref = NativeBatch(eng, min(eng.max_rows(), 4)), TorchBatch(m)
    rows = {}

    def join(i):
        for batch in (nat, ref):
            cache, first = _prompt(m, prompts[i])
            r = Row(i)
            r.generated.append(first)
            batch.join(r, cache, len(prompts[i]))
        rows[i] = first

    def step():
        toks_n = torch.tensor([r.generated[-1] for r in nat.rows])
        toks_r = torch.tensor([r.generated[-1] for r in ref.rows])
        assert torch.equal(toks_n, toks_r)
        ln, lr = nat.step(toks_n), ref.step(toks_r)
        assert ln.shape == lr.shape
        assert decode.close(ln.float(), lr.float()), (ln.float() - lr.float()).abs().max()
        for batch, logits in ((nat, ln), (ref, lr)):
            for r, row in zip(batch.rows, logits):
                r.generated.append(int(row.float().argmax()))

    def leave(i):
        for batch in (nat, ref):
            batch.remove([j for j, r in enumerate(batch.rows) if r.name == i])

    with torch.inference_mode():
        join(0)
        for _ in range(3):
            step()
        join(1)  # wider than the batch: the batch's rows move right
        step()
        join(2)  # narrower: the new row is left-padded
        for _ in range(2):
            step()
        leave(1)  # the widest row leaves: every remaining row's padding trimmed
        assert nat.S == int(nat.lengths.max())
        step()
        cap = nat.capacity
        join(3)  # 300 tokens: past the capacity, which grows with the used columns kept
        assert nat.capacity > cap
        for _ in range(4):
            step()
        leave(0)
        leave(3)
        join(4)
        for _ in range(3):
            step()
    assert [r.generated for r in nat.rows] == [r.generated for r in ref.rows]
    assert len(nat.rows) == 2 and nat.S == int(nat.lengths.max())


def _near(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal up to the numerics' difference between one row and several: past one row per expert/linear the 4-bit
    rows take the activations as int16 per 32 columns (docs/serve.md), a few bf16 units on a logit."""
    return bool(((a - b).abs() <= 2.0 ** -5 * torch.maximum(a.abs(), b.abs()) + 2.0 ** -7 * a.abs().max()).all())


@pytest.mark.parametrize("rooms", [(4, 4), (16,)])
def test_full_native_batches_step_each_row_as_alone_within_rounding(tiny_model, rooms):
    """Rows in native batches — two of four (the server's split past the step's rows), or sixteen in one step, where
    the tiny model's 4 experts get up to 16 rows each and the fused MoE runs them in passes of 8 — give each row the
    logits it gets decoding alone, within the several-rows numerics (a few bf16 units)."""
    from moeq.nn import engine
    from moeq.serve import loader
    from moeq.serve.batch import NativeBatch

    m, _, _, _ = loader(str(tiny_model), quant="q4_0", batch=16)()
    eng = engine.current(m)
    if eng.max_rows() < max(rooms):
        pytest.skip(f"this CPU's head takes {eng.max_rows()} rows per native step")
    g = torch.Generator().manual_seed(1)
    n = sum(rooms)
    prompts = [torch.randint(0, m.config.vocab_size, (int(k),), generator=g).tolist()
               for k in torch.randint(2, 30, (n,), generator=g)]
    batches = [NativeBatch(eng, r) for r in rooms]
    with torch.inference_mode():
        firsts, at = [], 0
        for b, room in zip(batches, rooms):
            for i in range(at, at + room):
                cache, first = _prompt(m, prompts[i])
                b.join(Row(i), cache, len(prompts[i]))
                firsts.append(first)
            at += room
        together, at = [], 0
        for b, room in zip(batches, rooms):
            together.append(b.step(torch.tensor(firsts[at:at + room])))
            at += room
        together = torch.cat(together)
        for i, p in enumerate(prompts):
            alone = NativeBatch(eng, 1)
            cache, _ = _prompt(m, p)
            alone.join(Row(i), cache, len(p))
            got = alone.step(torch.tensor([firsts[i]]))
            assert _near(got.float(), together[i:i + 1].float()), i

def _run(sched, prompts, max_tokens=8):
    """Submit every prompt at once; return each request's generated ids once all are done."""
    import threading

    from moeq.serve.scheduler import Request

    reqs, events = [], []
    for p in prompts:
        ev = threading.Event()
        req = Request(prompt=p, max_tokens=max_tokens, ignore_eos=True,
                      emit=lambda kind, payload, ev=ev: ev.set() if kind in ("done", "error") else None)
        assert sched.submit(req)
        reqs.append(req)
        events.append(ev)
    for ev in events:
        assert ev.wait(120)
    return [r.generated for r in reqs]


@pytest.mark.parametrize("fail_together", [False, True])
def test_prompts_prefilled_together_decode_as_alone(tiny_model, monkeypatch, fail_together):
    """Prompts that arrive together run as one left-padded forward (one read of the experts for all) and each
    request then generates what it generates alone; when that forward fails, each prompt runs alone instead and
    every request still completes."""
    from moeq.serve import loader
    from moeq.serve.scheduler import Scheduler

    m, tok, stops, _ = loader(str(tiny_model), quant="q4_0", batch=8)()
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, m.config.vocab_size, (n,), generator=g).tolist() for n in (3, 17, 40, 9, 60)]
    sched = Scheduler(m, tok, [], max_batch=8, chunk=256)
    together_calls, finished = [], []
    real = Scheduler._prefill_together

    def spy(self, group):
        together_calls.append(len(group))
        if fail_together:
            raise RuntimeError("injected")
        real(self, group)
        finished.append(len(group))

    monkeypatch.setattr(Scheduler, "_prefill_together", spy)
    sched.start()
    try:
        alone = [_run(sched, [p])[0] for p in prompts]  # the first also decides the batch kind
        assert not together_calls
        together = _run(sched, prompts)
    finally:
        sched.stop()
    assert together_calls and max(together_calls) >= 2  # they did run together (or tried to)
    assert finished == ([] if fail_together else together_calls)
    assert together == alone
    assert not sched.rows and not sched.admitted


def test_models_without_the_native_step_batch_through_their_forward(tiny_model, monkeypatch):
    """Where the model has no native decode step (engine.current gives None), the scheduler's batches run the model's
    forward: concurrent requests joining and leaving give the tokens each gives alone."""
    from moeq.nn import engine
    from moeq.serve import loader
    from moeq.serve.batch import TorchBatch
    from moeq.serve.scheduler import Scheduler

    monkeypatch.setattr(engine, "current", lambda model: None)
    m, tok, _, _ = loader(str(tiny_model), quant="q4_0", batch=8)()
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, m.config.vocab_size, (n,), generator=g).tolist() for n in (4, 30, 11)]
    sched = Scheduler(m, tok, [], max_batch=8, chunk=256)
    kinds = []
    real = TorchBatch.step

    def step(self, tokens):
        kinds.append(len(self.rows))
        return real(self, tokens)

    monkeypatch.setattr(TorchBatch, "step", step)
    sched.start()
    try:
        alone = [_run(sched, [p], max_tokens=6)[0] for p in prompts]
        together = _run(sched, prompts, max_tokens=6)
    finally:
        sched.stop()
    assert sched.engine is None and max(kinds) >= 2
    assert together == alone


@pytest.mark.parametrize("rows", [4, 16])
def test_native_batches_only_where_one_step_holds_every_admitted_row(tiny_model, monkeypatch, rows):
    """A server admitting 8 rows decodes on the native step where one step takes 8 (here: the engine says 16), and
    through the model's forward where it takes fewer (4: AVX2's head), not in several native steps."""
    from moeq.nn import engine
    from moeq.serve import loader
    from moeq.serve.batch import NativeBatch, TorchBatch
    from moeq.serve.scheduler import Scheduler

    monkeypatch.setattr(engine.Engine, "max_rows", lambda self: rows)
    m, tok, _, _ = loader(str(tiny_model), quant="q4_0", batch=8)()
    sched = Scheduler(m, tok, [], max_batch=8, chunk=256)
    kinds = set()
    for kind in (NativeBatch, TorchBatch):
        real = kind.step
        monkeypatch.setattr(kind, "step", lambda self, t, real=real: kinds.add(type(self).__name__) or real(self, t))
    sched.start()
    try:
        _run(sched, [[5, 6, 7], [8, 9, 10, 11]], max_tokens=3)
    finally:
        sched.stop()
    assert kinds == ({"NativeBatch"} if rows >= 8 else {"TorchBatch"})
