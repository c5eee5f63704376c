"""Serving throughput and latency: ``moeq serve`` against llama.cpp's ``llama-server`` on the same weights.

The ``moeq bench`` model (Qwen3-30B-A3B layer shapes, random bf16, ``--layers`` deep) quantized to Q4_0 once and held
both ways losslessly (moeq's ``q4_0`` saved folder; the GGUF moeq exports from it, which llama-server reads). For
each system in turn (alternating over ``--rounds``): start its server on loopback with the same thread count, warm it
up, then for each concurrency N (1/4/8/16) N clients each send ``--requests`` streamed completions of
``--prompt-tokens`` tokens in and ``--new-tokens`` out (``ignore_eos``, greedy; llama-server's prompt cache off, so
every request prefills its prompt as moeq's does). Per N: aggregate generated tok/s over
the wall time, p50/p99 time to first token, p50/p99 inter-token latency (a request's (last - first token) /
(tokens - 1)). Best round per cell, the median in the JSON too.

    python benchmarks/bench_serve.py [--layers 4] [--clients 1 4 8 16] [--rounds 2] [--out FILE]

llama-server: built from the llama-cpp-python sdist's llama.cpp like llama-bench (``benchmarks/llamacpp.py``), with
``-DLLAMA_BUILD_SERVER=ON`` and ``--target llama-server``.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import httpx2 as httpx  # noqa: E402

import moeq  # noqa: E402
from moeq import bench  # noqa: E402
from moeq.export import export  # noqa: E402
from llamacpp import CACHE, build_flags, find_tool  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prepare(layers: int) -> tuple[Path, Path]:
    """(moeq q4_0 folder, the same weights as GGUF), built once in the caches."""
    src = bench.write_model(Path.home() / ".cache" / "moeq-bench" / f"qwen3-30b-a3b-shape-{layers}L-v151936", layers)
    if not (src / "tokenizer.json").exists():  # random weights: a byte-level tokenizer (GGUF pads its vocabulary)
        from moeq.tiny import tiny_tokenizer

        tiny_tokenizer().save_pretrained(src)
    folder = CACHE / f"serve-{layers}L-q4_0"
    gguf = CACHE / f"serve-{layers}L-q4_0.gguf"
    if not folder.exists() or not gguf.exists():
        model = moeq.load(src, quant="q4_0", progress=False)
        if not folder.exists():
            moeq.save(model, folder, source=src)
        if not gguf.exists():
            export(model, gguf, "gguf", source=src, check=False)  # q4_0: lossless by construction
    return folder, gguf


class Running:
    def __init__(self, cmd: list[str], url: str, env: dict | None = None):
        self.url = url
        self.log = open(CACHE / f"serve-{Path(cmd[0]).name}.log", "w+")  # read on failure (a pipe could fill up)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, **(env or {})})
        deadline = time.monotonic() + 600
        while True:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"{cmd[0]} exited: {self.log.read()[-2000:]}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{cmd[0]} did not become ready")
            time.sleep(0.5)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def start(system: str, folder: Path, gguf: Path, threads: int, slots: int, ctx: int, server_exe: Path) -> Running:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    if system == "moeq":
        return Running([sys.executable, "-m", "moeq.cli", "serve", str(folder), "--port", str(port), "--name", "m",
                        "--max-concurrency", str(slots), "--ctx", str(ctx)], url,
                       {"OMP_NUM_THREADS": str(threads)})
    return Running([str(server_exe), "-m", str(gguf), "--port", str(port), "-t", str(threads), "-tb", str(threads),
                    "-np", str(slots), "-c", str(ctx * slots), "--no-webui", "-a", "m"], url)


async def one(client, url: str, prompt: str, new: int, extra: dict) -> dict:
    body = {"model": "m", "prompt": prompt, "max_tokens": new, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}, **extra}
    t0 = time.perf_counter()
    first = last = None
    chunks, tokens = 0, None
    async with client.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            d = json.loads(line[6:])
            if d.get("usage"):
                tokens = d["usage"].get("completion_tokens", tokens)
            for c in d.get("choices") or []:  # one chunk per token on both servers (its text may be empty)
                if c.get("finish_reason") is None:
                    now = time.perf_counter()
                    first = first or now
                    last = now
                    chunks += 1
    tokens = tokens or chunks
    return {"ttft": first - t0, "itl": (last - first) / max(tokens - 1, 1), "tokens": tokens}


async def load(url: str, clients: int, requests: int, prompt: str, new: int, extra: dict) -> dict:
    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(limits=limits) as client:
        async def user():
            return [await one(client, url, prompt, new, extra) for _ in range(requests)]
        t0 = time.perf_counter()
        done = await asyncio.gather(*[user() for _ in range(clients)])
        wall = time.perf_counter() - t0
    rows = [r for u in done for r in u]

    def pct(xs, q):
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(q * len(xs)))]
    ttft, itl = [r["ttft"] for r in rows], [r["itl"] for r in rows]
    return {"clients": clients, "requests": len(rows), "tokens": sum(r["tokens"] for r in rows), "wall_s": wall,
            "tok_s": sum(r["tokens"] for r in rows) / wall, "ttft_p50_ms": 1e3 * pct(ttft, 0.5),
            "ttft_p99_ms": 1e3 * pct(ttft, 0.99), "itl_p50_ms": 1e3 * pct(itl, 0.5), "itl_p99_ms": 1e3 * pct(itl, 0.99)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=2, help="requests per client per concurrency")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--llama-server", default=None)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "serve.json"))
    args = ap.parse_args()
    exe = find_tool("llama-server", args.llama_server)
    if exe is None or not exe.exists():
        print("llama-server not found: build it as this script's docstring says (or pass --llama-server)")
        return
    folder, gguf = prepare(args.layers)
    from moeq.generation import load_tokenizer

    tok = load_tokenizer(folder)
    words = "the sea is wide and the ship is small and the wind is cold ".split()
    prompt = " ".join(words[i % len(words)] for i in range(args.prompt_tokens))
    while len(tok(prompt).input_ids) > args.prompt_tokens:
        prompt = prompt.rsplit(" ", 1)[0]
    slots, ctx = max(args.clients), args.prompt_tokens + args.new_tokens + 64
    rounds = []
    for rnd in range(args.rounds):
        order = ("llama-server", "moeq") if rnd % 2 == 0 else ("moeq", "llama-server")
        for system in order:
            srv = start(system, folder, gguf, args.threads, slots, ctx, exe)
            # every request prefills its prompt: llama-server would otherwise reuse the KV of the same prompt
            extra = {"cache_prompt": False} if system == "llama-server" else {}
            try:
                asyncio.run(load(srv.url, 1, 1, prompt, 8, extra))  # warm-up
                for n in args.clients:
                    got = None
                    for attempt in range(3):  # a server that went away mid-run: restarted, the run redone
                        try:
                            got = asyncio.run(load(srv.url, n, args.requests, prompt, args.new_tokens, extra))
                            break
                        except httpx.HTTPError as e:
                            print(f"{system} failed at {n} clients ({type(e).__name__}); restarting it", flush=True)
                            srv.stop()
                            srv = start(system, folder, gguf, args.threads, slots, ctx, exe)
                            asyncio.run(load(srv.url, 1, 1, prompt, 8, extra))
                    if got is None:  # recorded as failed; the cell's best comes from the other rounds
                        rounds.append({"round": rnd, "system": system, "clients": n, "failed": True})
                        continue
                    got["restarts"] = attempt
                    row = {"round": rnd, "system": system, **got}
                    rounds.append(row)
                    print(json.dumps(row), flush=True)
            finally:
                srv.stop()
    best, median = {}, {}
    for system in ("llama-server", "moeq"):
        for n in args.clients:
            rows = [r for r in rounds if r["system"] == system and r["clients"] == n and not r.get("failed")]
            best.setdefault(system, {})[str(n)] = max(rows, key=lambda r: r["tok_s"])
            median.setdefault(system, {})[str(n)] = {k: statistics.median(r[k] for r in rows)
                                                     for k in ("tok_s", "ttft_p50_ms", "itl_p50_ms")}
    out = {"cpu": bench.cpu_summary(), "threads": args.threads, "layers": args.layers,
           "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens, "requests_per_client": args.requests,
           "weights": "Q4_0 experts + attention, bf16 head (the same bytes both sides)",
           "llama_server": str(exe), "llama_build": build_flags(exe),
           "rounds": rounds, "best": best, "median": median}
    Path(args.out).write_text(json.dumps(out, indent=1))
    print("wrote", args.out)


if __name__ == "__main__":
    main()
