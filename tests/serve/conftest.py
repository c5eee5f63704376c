"""A live ``moeq serve`` on loopback for the server tests: a real process (uvicorn, the CLI's own command), a tiny
checkpoint, a free port; stopped with SIGTERM (and checked to exit 0) when the tests are done."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx2 as httpx
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("openai")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model: Path, *args: str, env: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(model.parent / f"serve-{self.port}.log", "w+")
        self.proc = subprocess.Popen([sys.executable, "-m", "moeq.cli", "serve", str(model), "--port", str(self.port),
                                      *args], stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})})
        deadline = time.monotonic() + 120
        while True:
            assert self.proc.poll() is None, self.output()
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "server did not become ready: " + self.output()
            time.sleep(0.2)

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-4000:]

    def stop(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    from moeq.tiny import make_checkpoint

    return make_checkpoint("qwen3_moe", tmp_path_factory.mktemp("serve") / "tiny")


@pytest.fixture(scope="module")
def server(tiny_model):
    s = Server(tiny_model, "--max-concurrency", "4", "--max-queue", "32", "--ctx", "256")
    yield s
    assert s.stop() == 0, s.output()
