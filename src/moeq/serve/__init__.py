"""``moeq serve``: an OpenAI-compatible HTTP server (Starlette/FastAPI on uvicorn) with continuous batching over
moeq's multi-row kernels, and a chat page. :func:`serve` is what the CLI calls; :func:`create_app` builds the ASGI
app for any other ASGI server."""
from __future__ import annotations

import contextlib
import logging
import signal
import threading
from pathlib import Path

log = logging.getLogger(__name__)


def loader(model: str, quant=None, dtype=None, device="cpu", context: int | None = None, batch: int = 1):
    """A function loading ``model`` (anything ``moeq.load`` takes) with its tokenizer, stop ids and context; for
    batches past the bf12 head's native rows, the head is held as bf16 (``moeq.nn.decode.head_for_batches``) unless the
    bf12 one serves batches faster here (``moeq.nn.bf12.serves_batches``)."""
    def load():
        import moeq  # noqa: PLC0415
        from moeq.generation import context_length, load_tokenizer, stop_ids  # noqa: PLC0415
        from moeq.nn import bf12, decode  # noqa: PLC0415

        m = moeq.load(model, quant=quant, dtype=dtype, progress=False, device=device)
        if batch > bf12.MAX_ROWS and not bf12.serves_batches() and decode.head_for_batches(m):
            log.info("head held as bf16 for batches of up to %d rows", batch)
        tok = load_tokenizer(model)
        ctx = context_length(m)
        if context is not None:
            ctx = context if ctx is None else min(ctx, context)
        return m, tok, stop_ids(tok, m), ctx
    return load


def create_app(model: str, quant=None, dtype=None, device="cpu", name: str | None = None, api_key: str | None = None,
               max_concurrency: int = 8, max_queue: int | None = None, context: int | None = None,
               chunk: int = 256):
    from moeq.serve.app import State, create_app as build  # noqa: PLC0415

    state = State(name or Path(model).name, loader(model, quant, dtype, device, context, max_concurrency), api_key,
                  max_concurrency,
                  4 * max_concurrency if max_queue is None else max_queue, chunk)
    return build(state)


def serve(model: str, host: str = "127.0.0.1", port: int = 8000, log_level: str = "warning", **kw) -> int:
    """Run the server until SIGTERM/SIGINT: it stops accepting, lets in-flight replies finish (up to 30 s), stops
    the scheduler, and returns 0."""
    import importlib.util  # noqa: PLC0415

    from moeq.errors import MoeqError  # noqa: PLC0415

    missing = [m for m in ("fastapi", "uvicorn") if importlib.util.find_spec(m) is None]
    if missing:
        raise MoeqError(f"moeq serve needs {' and '.join(missing)}: pip install 'moeq[serve]'")
    import uvicorn  # noqa: PLC0415

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            """uvicorn's graceful shutdown on SIGTERM/SIGINT, without re-raising the signal afterwards (the process
            then exits 0: a requested stop is not a failure)."""
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            old = {s: signal.signal(s, self.handle_exit) for s in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for s, h in old.items():
                    signal.signal(s, h)

    app = create_app(model, **kw)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=30,
                            access_log=False)
    server = Server(config)
    log.warning("moeq serve: http://%s:%d (model %s)", host, port, model)
    server.run()
    return 0
