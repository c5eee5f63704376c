"""The HTTP side of ``moeq serve``: a Starlette/FastAPI app speaking the OpenAI API over the continuous-batching
:class:`~moeq.serve.scheduler.Scheduler` — ``/v1/chat/completions``, ``/v1/completions`` (both streamed as SSE or
not), ``/v1/models``, ``/health``, ``/metrics`` (Prometheus text) and the chat page at ``/``.

The model loads in a background thread after the server is up: until it is ready the API answers 503 and
``/health`` says ``loading``. Request handlers only parse, validate and wait on their request's event queue; the
scheduler thread owns the model."""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import threading
import time
import uuid
from importlib import resources
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, StreamingResponse

from moeq.serve.protocol import MAX_BODY, ApiError, Params, parse_json, parse_params
from moeq.serve.scheduler import Request as Job
from moeq.serve.scheduler import Scheduler

log = logging.getLogger(__name__)


class State:
    """What the handlers share: the model once loaded, its scheduler, and the counters ``/metrics`` reports."""

    def __init__(self, name: str, load: Callable[[], tuple], api_key: str | None, max_batch: int, max_queue: int,
                 chunk: int):
        self.name, self.load, self.api_key = name, load, api_key
        self.max_batch, self.max_queue, self.chunk = max_batch, max_queue, chunk
        self.sched: Scheduler | None = None
        self.tok = None
        self.context: int | None = None
        self.load_error: str | None = None
        self.requests: dict[tuple[str, int], int] = {}
        self.created = int(time.time())

    def start_loading(self) -> None:
        def work():
            try:
                model, tok, stop_ids, context = self.load()
                sched = Scheduler(model, tok, stop_ids, self.max_batch, self.max_queue, self.chunk, context)
                sched.start()
                self.tok, self.context, self.sched = tok, context, sched
                log.info("model %s ready", self.name)
            except Exception as e:  # the server stays up and says why (health and every request)
                log.exception("loading failed")
                self.load_error = f"{type(e).__name__}: {e}"
        threading.Thread(target=work, name="moeq-load", daemon=True).start()

    def count(self, endpoint: str, status: int) -> None:
        self.requests[(endpoint, status)] = self.requests.get((endpoint, status), 0) + 1


def error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


def create_app(state: State) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app):
        state.start_loading()
        yield
        if state.sched is not None:
            await asyncio.to_thread(state.sched.stop)

    app = FastAPI(title="moeq serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    def ready() -> Scheduler:
        if state.load_error is not None:
            raise ApiError(500, f"the model failed to load: {state.load_error}", kind="server_error")
        if state.sched is None:
            raise ApiError(503, "the model is loading; retry shortly", kind="server_error", code="model_loading")
        if state.sched.error is not None:
            raise ApiError(500, f"the scheduler stopped: {state.sched.error}", kind="server_error")
        return state.sched

    def authorize(request: Request) -> None:
        if state.api_key is None:
            return
        got = request.headers.get("authorization", "")
        if not hmac.compare_digest(got.encode(), f"Bearer {state.api_key}".encode()):
            raise ApiError(401, "invalid API key", kind="authentication_error", code="invalid_api_key")

    async def body(request: Request) -> dict:
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > MAX_BODY):
            raise ApiError(413, f"request body exceeds the limit of {MAX_BODY} bytes", code="request_too_large")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_BODY:
                raise ApiError(413, f"request body exceeds the limit of {MAX_BODY} bytes", code="request_too_large")
            chunks.append(chunk)
        return parse_json(b"".join(chunks))

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError):
        return error_response(e)

    @app.get("/health")
    async def health():
        if state.load_error is not None:
            return JSONResponse({"status": "error", "error": state.load_error}, status_code=500)
        if state.sched is None:
            return JSONResponse({"status": "loading"}, status_code=503)
        return {"status": "ok", **state.sched.depth()}

    @app.get("/v1/models")
    async def models(request: Request):
        authorize(request)
        return {"object": "list", "data": [{"id": state.name, "object": "model", "created": state.created,
                                            "owned_by": "moeq"}]}

    @app.get("/metrics")
    async def metrics():
        lines = ["# TYPE moeq_requests_total counter"]
        for (ep, st), n in sorted(state.requests.items()):
            lines.append(f'moeq_requests_total{{endpoint="{ep}",status="{st}"}} {n}')
        s = state.sched
        if s is not None:
            d = s.depth()
            for name, kind, value in (("prompt_tokens_total", "counter", s.stats["prompt_tokens"]),
                                      ("generated_tokens_total", "counter", s.stats["tokens"]),
                                      ("decode_steps_total", "counter", s.stats["steps"]),
                                      ("requests_waiting", "gauge", d["waiting"]),
                                      ("requests_prefilling", "gauge", d["prefilling"]),
                                      ("requests_decoding", "gauge", d["decoding"]),
                                      ("batch_size", "gauge", s.stats["last_batch"]),
                                      ("batch_size_max", "gauge", s.stats["max_batch"]),
                                      ("tokens_per_second", "gauge", round(s.tokens_per_second(), 3))):
                lines += [f"# TYPE moeq_{name} {kind}", f"moeq_{name} {value}"]
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    @app.get("/", response_class=HTMLResponse)
    async def page():
        return HTMLResponse(resources.files("moeq.serve").joinpath("static/chat.html").read_text("utf-8"))

    async def complete(request: Request, chat: bool):
        endpoint = "chat" if chat else "completions"
        try:
            authorize(request)
            data = await body(request)
            sched = ready()
            p = parse_params(data, chat)
            if p.model != state.name:
                raise ApiError(404, f"model '{p.model}' does not exist; this server serves '{state.name}'",
                               param="model", code="model_not_found")
            prompt = await asyncio.to_thread(_encode, state.tok, p)
            ctx = state.context
            if ctx is not None and len(prompt) >= ctx:
                raise ApiError(400, f"the prompt is {len(prompt)} tokens; this model's context is {ctx}",
                               param="messages" if chat else "prompt", code="context_length_exceeded")
            max_tokens = p.max_tokens if p.max_tokens is not None else (ctx - len(prompt) if ctx else 1024)
            if ctx is not None and len(prompt) + max_tokens > ctx:
                raise ApiError(400, f"the prompt ({len(prompt)} tokens) plus max_tokens ({max_tokens}) exceed this "
                                    f"model's context of {ctx}", param="max_tokens", code="context_length_exceeded")
            loop = asyncio.get_running_loop()
            events: asyncio.Queue = asyncio.Queue()
            job = Job(prompt=prompt, max_tokens=max_tokens, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k,
                      seed=p.seed, stop=p.stop, ignore_eos=p.ignore_eos,
                      emit=lambda kind, payload: loop.call_soon_threadsafe(events.put_nowait, (kind, payload)))
            if not sched.submit(job):
                raise ApiError(429, f"too many requests: {state.max_queue} already waiting", kind="rate_limit_error",
                               code="rate_limit_exceeded")
        except ApiError as e:
            state.count(endpoint, e.status)
            return error_response(e)
        state.count(endpoint, 200)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        if p.stream:
            return StreamingResponse(_stream(job, events, rid, p, chat, state.name), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await _whole(request, job, events, rid, chat, state.name)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await complete(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await complete(request, chat=False)

    return app


def _encode(tok, p: Params) -> list[int]:
    from moeq.generation import chat_ids  # noqa: PLC0415

    ids = chat_ids(tok, p.messages) if p.messages is not None else tok(p.prompt).input_ids
    if not ids:
        raise ApiError(400, "the prompt encodes to no tokens", param="prompt")
    return list(ids)


def _usage(done: dict) -> dict:
    return {"prompt_tokens": done["prompt_tokens"], "completion_tokens": done["completion_tokens"],
            "total_tokens": done["prompt_tokens"] + done["completion_tokens"]}


async def _whole(request: Request, job: Job, events: asyncio.Queue, rid: str, chat: bool, model: str):
    """A non-streamed reply; a client that disconnects meanwhile cancels its request."""
    text = []
    while True:
        try:
            kind, payload = await asyncio.wait_for(events.get(), timeout=0.5)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                job.cancelled.set()
                return JSONResponse({}, status_code=499)
            continue
        if kind == "text":
            text.append(payload)
        elif kind == "error":
            return error_response(ApiError(500, payload, kind="server_error"))
        else:
            content = "".join(text)
            choice = ({"index": 0, "message": {"role": "assistant", "content": content},
                       "finish_reason": payload["finish_reason"], "logprobs": None} if chat else
                      {"index": 0, "text": content, "finish_reason": payload["finish_reason"], "logprobs": None})
            return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                    "model": model, "choices": [choice], "usage": _usage(payload)}


async def _stream(job: Job, events: asyncio.Queue, rid: str, p: Params, chat: bool, model: str):
    """SSE chunks as tokens arrive, ``data: [DONE]`` last; a client that goes away (the generator is closed)
    cancels its request."""
    created = int(time.time())
    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(delta: str | None, finish: str | None = None, first: bool = False) -> str:
        if chat:
            d = {} if delta is None else ({"role": "assistant", "content": delta} if first else {"content": delta})
            choice = {"index": 0, "delta": d, "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": 0, "text": delta or "", "finish_reason": finish, "logprobs": None}
        out = {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}
        if p.include_usage:
            out["usage"] = None
        return f"data: {json.dumps(out)}\n\n"

    try:
        if chat:
            yield chunk("", first=True)
        while True:
            kind, payload = await events.get()
            if kind == "text":
                yield chunk(payload)  # one chunk per token, its text possibly empty
            elif kind == "error":
                yield f"data: {json.dumps(ApiError(500, payload, kind='server_error').body())}\n\n"
                break
            else:
                yield chunk(None if chat else "", payload["finish_reason"])
                if p.include_usage:
                    usage = {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
                             "usage": _usage(payload)}
                    yield f"data: {json.dumps(usage)}\n\n"
                break
        yield "data: [DONE]\n\n"
    finally:
        job.cancelled.set()  # a no-op when it finished; frees its row at the next step when the client left
