"""``moeq serve`` through the official ``openai`` client (and raw HTTP where a client would refuse to send the
request) against a live server on loopback: chat and completions, streamed and not, stop sequences, seeds, usage,
every error status, disconnects, continuous batching, a bounded load test, SIGTERM."""
from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx2 as httpx
import openai
import pytest

from tests.serve.conftest import Server

MODEL = "tiny"


def client(server, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=kw.pop("api_key", "none"), max_retries=0, **kw)


def chat(c, text: str, **kw):
    return c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}], **kw)


def health(server) -> dict:
    return httpx.get(server.url + "/health", timeout=5).json()


def wait_idle(server, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        h = health(server)
        if h["waiting"] == h["prefilling"] == h["decoding"] == 0:
            return h
        assert time.monotonic() < deadline, h
        time.sleep(0.05)


def test_models_health_metrics_page(server):
    c = client(server)
    assert [m.id for m in c.models.list().data] == [MODEL]
    assert health(server)["status"] == "ok"
    page = httpx.get(server.url + "/")
    assert page.status_code == 200 and "<title>moeq chat</title>" in page.text
    chat(c, "hi", max_tokens=3, temperature=0)
    m = httpx.get(server.url + "/metrics").text
    assert 'moeq_requests_total{endpoint="chat",status="200"}' in m and "moeq_generated_tokens_total" in m


def test_chat_streamed_equals_whole_with_usage(server):
    c = client(server)
    whole = chat(c, "Tell me about the sea", max_tokens=12, temperature=0)
    assert whole.choices[0].finish_reason in ("length", "stop")
    whole = chat(c, "Tell me about the sea", max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 12
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + 12 and whole.usage.prompt_tokens > 5
    parts, usage, finish = [], None, None
    for ev in chat(c, "Tell me about the sea", max_tokens=12, temperature=0, stream=True,
                   stream_options={"include_usage": True}, extra_body={"ignore_eos": True}):
        if ev.choices:
            parts.append(ev.choices[0].delta.content or "")
            finish = ev.choices[0].finish_reason or finish
        if ev.usage is not None:
            usage = ev.usage
    assert "".join(parts) == whole.choices[0].message.content and finish == "length"
    assert usage.completion_tokens == 12 and usage.prompt_tokens == whole.usage.prompt_tokens


def test_completions_stop_sequences(server):
    c = client(server)
    full = c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=24, temperature=0)
    text = full.choices[0].text
    assert full.object == "text_completion" and len(text) > 6
    stop = text[4:6]
    assert stop.strip(), text
    cut = c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=24, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].text == text[:text.find(stop)]
    streamed = "".join(ev.choices[0].text for ev in c.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=24, temperature=0, stop=stop, stream=True) if ev.choices)
    assert streamed == cut.choices[0].text


def test_seeds_reproduce_sampling(server):
    c = client(server)
    a, b, other = (chat(c, "Pick words", max_tokens=16, temperature=1.0, top_p=0.95, seed=s, extra_body={"top_k": 50})
                   .choices[0].message.content for s in (7, 7, 8))
    assert a == b and a != other


def test_error_statuses(server):
    c = client(server)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        c.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="context"):
        chat(c, "word " * 400, max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="context"):
        chat(c, "hi", max_tokens=10 ** 6)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        chat(c, "hi", max_tokens=-5)
    with pytest.raises(openai.BadRequestError, match="'n'"):
        chat(c, "hi", n=2)
    with pytest.raises(openai.BadRequestError, match="unknown parameter 'foo'"):
        chat(c, "hi", extra_body={"foo": 1})

    def post(content: bytes, path="/v1/chat/completions"):
        return httpx.post(server.url + path, content=content, headers={"Content-Type": "application/json"},
                          timeout=30)
    cases = [
        (b"{not json", 400, "not valid JSON"),
        (b'{"model": "tiny", "messages": "hi"}', 400, "messages"),
        (b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "temperature": "hot"}', 400,
         "temperature"),
        (b'{"model": "tiny", "messages": [{"role": "user", "content": "\xff\xfe"}]}', 400, "UTF-8"),
        (b"[" * 100000 + b"]" * 100000, 400, "nested too deeply"),
        (b"x" * (10 << 20), 413, "exceeds the limit"),
        (json.dumps({"model": "tiny", "prompt": ["a", "b"]}).encode(), 400, "prompt"),
    ]
    for body, status, text in cases:
        r = post(body, "/v1/completions" if b'"prompt"' in body else "/v1/chat/completions")
        assert r.status_code == status, (body[:60], r.text[:200])
        err = r.json()["error"]
        assert text in err["message"] and err["type"], err
    assert chat(c, "still serving", max_tokens=2, temperature=0).usage.completion_tokens == 2


def test_api_key_and_queue_limit(tiny_model):
    s = Server(tiny_model, "--api-key", "sekrit", "--max-concurrency", "1", "--max-queue", "0")
    try:
        with pytest.raises(openai.AuthenticationError):
            chat(client(s, api_key="wrong"), "hi", max_tokens=2)
        c = client(s, api_key="sekrit")
        assert chat(c, "hi", max_tokens=2, temperature=0).usage.completion_tokens == 2
        stream = chat(c, "a long answer", max_tokens=200, temperature=0, stream=True, extra_body={"ignore_eos": True})
        next(iter(stream))  # its row is taken (and kept: no early end-of-sequence can free it before the next request)
        with pytest.raises(openai.RateLimitError):
            chat(c, "one more", max_tokens=2)
        stream.close()
        wait_idle(s)
        assert chat(c, "after", max_tokens=2, temperature=0).usage.completion_tokens == 2
    finally:
        assert s.stop() == 0, s.output()


def test_disconnect_mid_stream_frees_the_row(server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "go on forever"}], "max_tokens": 200,
            "stream": True, "temperature": 0}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=30) as r:
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data: ")
            if seen >= 3:
                break
    h = wait_idle(server)  # the server noticed and dropped the request at its next step
    assert h["decoding"] == 0
    assert chat(client(server), "next", max_tokens=3, temperature=0).usage.completion_tokens == 3


def test_batched_greedy_equals_alone(server):
    """Continuous batching: four requests decoding together (joining at different steps, different prompt lengths)
    give the tokens each gives alone."""
    c = client(server)
    prompts = ["A", "The quick brown fox jumps over", "one two three four five six seven eight nine ten",
               "Sing, goddess"]
    alone = [c.completions.create(model=MODEL, prompt=p, max_tokens=20, temperature=0).choices[0].text
             for p in prompts]
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda p: c.completions.create(model=MODEL, prompt=p, max_tokens=20,
                                                                temperature=0).choices[0].text, prompts))
    assert together == alone
    m = httpx.get(server.url + "/metrics").text
    widest = int(next(line.split()[1] for line in m.splitlines() if line.startswith("moeq_batch_size_max ")))
    assert widest >= 2  # they did share decode steps


def _rss(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def test_load_and_hostile_requests(server):
    """16 clients x 3 requests of mixed prompt lengths, with hostile requests and disconnects among them: every
    normal request completes, hostile ones get 4xx, no row is left behind, memory stays flat across rounds."""
    c = client(server, timeout=120)
    words = "the sea is wide and the ship is small ".split()

    def user(i: int) -> list[int]:
        got = []
        for j in range(3):
            prompt = " ".join(words[(i + k) % len(words)] for k in range(1 + (i * 7 + j * 13) % 60))
            r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=8 + (i + j) % 9, temperature=0)
            got.append(r.usage.completion_tokens)
        return got

    hostile_status = []

    def hostile():
        for body in (b"x" * (10 << 20), b"[" * 50000, b'{"model": "tiny", "prompt": "\xc3\x28"}',
                     json.dumps({"model": MODEL, "prompt": "x", "max_tokens": -1}).encode(),
                     json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 1 << 40}).encode()):
            r = httpx.post(server.url + "/v1/completions", content=body, timeout=60,
                           headers={"Content-Type": "application/json"})
            hostile_status.append(r.status_code)
        with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                          json={"model": MODEL, "prompt": "abc", "max_tokens": 100, "stream": True}) as r:
            next(r.iter_lines())

    rss = []
    for _ in range(3):
        with ThreadPoolExecutor(17) as pool:
            futs = [pool.submit(user, i) for i in range(16)] + [pool.submit(hostile)]
            results = [f.result(timeout=300) for f in futs[:16]]
            futs[16].result(timeout=300)
        assert all(len(r) == 3 and all(n > 0 for n in r) for r in results)
        wait_idle(server)
        rss.append(_rss(server.proc.pid))
    assert all(400 <= s < 500 for s in hostile_status), hostile_status
    assert rss[2] - rss[1] < 64 << 20, rss  # flat after the first round's allocations


def test_sigterm_finishes_cleanly(tiny_model):
    s = Server(tiny_model)
    got = []

    def stream():
        try:
            for ev in chat(client(s), "keep going", max_tokens=60, temperature=0, stream=True):
                got.append(ev)
        except openai.APIError:
            pass
    t = threading.Thread(target=stream)
    t.start()
    while not got:
        time.sleep(0.01)
    assert s.stop(timeout=60) == 0, s.output()
    t.join(30)
    assert not t.is_alive()
    assert s.proc.poll() == 0
