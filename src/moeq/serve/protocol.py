"""The OpenAI request and error shapes ``moeq serve`` speaks: every request body is untrusted — read within a size
limit, parsed as UTF-8 JSON (depth-bounded), each field type- and range-checked — and every refusal is OpenAI's
``{"error": {"message", "type", "param", "code"}}`` with the matching HTTP status."""
from __future__ import annotations

import dataclasses
import json

MAX_BODY = 4 << 20  # bytes: a request larger than this is refused (413) before it is parsed
MAX_STOP = 4  # stop sequences per request (OpenAI's limit)

# parameters accepted with any value that does not change what is computed, and those accepted only at their
# default (anything else would change the output: refused rather than ignored)
IGNORED = {"user", "metadata", "store", "service_tier", "parallel_tool_calls", "stream_options"}
DEFAULT_ONLY = {"n": 1, "frequency_penalty": 0, "presence_penalty": 0, "logprobs": False, "top_logprobs": None,
                "logit_bias": None, "tools": None, "tool_choice": None, "response_format": None, "echo": False,
                "best_of": 1, "suffix": None, "functions": None, "function_call": None}
COMMON = {"model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "stop", "seed", "stream",
          "ignore_eos"}  # top_k and ignore_eos: the extensions llama.cpp's server and vLLM take


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def parse_json(body: bytes) -> dict:
    if len(body) > MAX_BODY:
        raise ApiError(413, f"request body of {len(body)} bytes exceeds the limit of {MAX_BODY}",
                       code="request_too_large")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError(400, f"request body is not valid UTF-8 ({e.reason} at byte {e.start})") from None
    try:
        data = json.loads(text)
    except RecursionError:
        raise ApiError(400, "request body JSON is nested too deeply") from None
    except json.JSONDecodeError as e:
        raise ApiError(400, f"request body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"request body must be a JSON object, got {type(data).__name__}")
    return data


@dataclasses.dataclass
class Params:
    model: str
    max_tokens: int | None
    temperature: float
    top_p: float
    top_k: int
    stop: tuple[str, ...]
    seed: int | None
    stream: bool
    include_usage: bool
    ignore_eos: bool = False
    messages: list[dict] | None = None
    prompt: str | None = None


def _number(data: dict, key: str, lo: float, hi: float, default, integer: bool = False):
    v = data.get(key, default)
    if v is None:
        return default
    ok = (type(v) is int) if integer else (type(v) in (int, float))
    if not ok or not lo <= v <= hi:
        kind = "an integer" if integer else "a number"
        raise ApiError(400, f"'{key}' must be {kind} in [{lo}, {hi}], got {json.dumps(v)[:80]}", param=key)
    return v


def parse_params(data: dict, chat: bool) -> Params:
    allowed = COMMON | IGNORED | set(DEFAULT_ONLY) | ({"messages"} if chat else {"prompt"})
    for key in data:
        if key not in allowed:
            raise ApiError(400, f"unknown parameter '{key}'", param=key, code="unknown_parameter")
    for key, default in DEFAULT_ONLY.items():
        if key in data and data[key] != default and not (data[key] is None and default in (0, 1, False)):
            raise ApiError(400, f"'{key}'={json.dumps(data[key])[:80]} is not supported by moeq serve (only "
                                f"{json.dumps(default)})", param=key, code="unsupported_parameter")
    model = data.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "'model' is required (a string)", param="model")
    max_tokens = _number(data, "max_completion_tokens", 1, 1 << 30, None, integer=True)
    max_tokens = _number(data, "max_tokens", 1, 1 << 30, max_tokens, integer=True)
    stop = data.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if (not isinstance(stop, list) or len(stop) > MAX_STOP
            or not all(isinstance(s, str) and 0 < len(s) <= 256 for s in stop)):
        raise ApiError(400, f"'stop' must be a string or a list of up to {MAX_STOP} non-empty strings", param="stop")
    stream = data.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise ApiError(400, "'stream' must be a boolean", param="stream")
    opts = data.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise ApiError(400, "'stream_options' must be an object", param="stream_options")
    include_usage = bool((opts or {}).get("include_usage", False))
    p = Params(model=model, max_tokens=max_tokens,
               temperature=float(_number(data, "temperature", 0, 2, 1.0)),
               top_p=float(_number(data, "top_p", 0, 1, 1.0)),
               top_k=int(_number(data, "top_k", 0, 1 << 20, 0, integer=True)),
               stop=tuple(stop), seed=_number(data, "seed", -(1 << 63), (1 << 63) - 1, None, integer=True),
               stream=stream, include_usage=include_usage)
    ignore_eos = data.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise ApiError(400, "'ignore_eos' must be a boolean", param="ignore_eos")
    p.ignore_eos = ignore_eos
    if p.top_p == 0:
        p.temperature = 0.0  # nothing survives a zero nucleus but the top token
    if chat:
        msgs = data.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise ApiError(400, "'messages' must be a non-empty list", param="messages")
        out = []
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant"):
                raise ApiError(400, f"messages[{i}]: needs a role of system, developer, user or assistant",
                               param="messages")
            content = m.get("content")
            if isinstance(content, list):  # content parts: text only
                if not all(isinstance(c, dict) and c.get("type") == "text" and isinstance(c.get("text"), str)
                           for c in content):
                    raise ApiError(400, f"messages[{i}].content: only text parts are supported", param="messages")
                content = "".join(c["text"] for c in content)
            if not isinstance(content, str):
                raise ApiError(400, f"messages[{i}].content must be a string", param="messages")
            out.append({"role": "system" if m["role"] == "developer" else m["role"], "content": content})
        p.messages = out
    else:
        prompt = data.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise ApiError(400, "'prompt' must be a string (one prompt per request)", param="prompt")
        p.prompt = prompt
    return p
