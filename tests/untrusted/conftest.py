import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import moeq

ROOT = Path(__file__).resolve().parents[2]


class Isolated:
    """Runs jobs in tests/untrusted/worker.py; restarts it after a crash (the crash fails that job's test)."""

    def __init__(self):
        self.proc = None

    def _start(self):
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.untrusted.worker"], cwd=ROOT, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline().strip() == "READY", self.proc.stderr.read()

    def run(self, job: dict) -> dict:
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            rc = self.proc.wait()
            err = self.proc.stderr.read()[-3000:]
            self.proc = None
            pytest.fail(f"the worker crashed (exit {rc}) on {job}:\n{err}")
        return json.loads(line)

    def load(self, path, quant=None, ref=None, save=None, dtype=None) -> dict:
        return self.run({"op": "load", "path": str(path), "quant": quant, "ref": None if ref is None else str(ref),
                         "save": None if save is None else str(save), "dtype": dtype})

    def cli(self, *argv) -> dict:
        return self.run({"op": "cli", "argv": [str(a) for a in argv]})

    def close(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)


@pytest.fixture(scope="session")
def isolated():
    iso = Isolated()
    yield iso
    iso.close()


def assert_refused(reply: dict, *words: str) -> None:
    """A clear moeq error (never a crash, another exception, or a silent success) naming ``words``."""
    assert reply["outcome"] == "error", reply
    for w in words:
        assert w in reply["msg"], (w, reply["msg"])


@pytest.fixture(scope="session")
def saved(tiny_ckpt, tmp_path_factory, isolated):
    """saved(method, model_type="qwen3_moe", dtype=None) -> (moeq checkpoint dir, its reference logits file when run
    with compute dtype ``dtype``: None (as saved, bf16), "float16" or "float32")."""
    cache = {}

    def make(method, model_type="qwen3_moe", dtype=None):
        if (method, model_type) not in cache:
            d = tmp_path_factory.mktemp(f"saved-{method}-{model_type}")
            m = moeq.load(tiny_ckpt(model_type), quant=method, progress=False)
            moeq.save(m, d / "ckpt", source=tiny_ckpt(model_type))
            cache[(method, model_type)] = d
        d = cache[(method, model_type)]
        ref = d / f"ref-{dtype}.pt"
        if not ref.exists():
            reply = isolated.load(d / "ckpt", save=ref, dtype=dtype)
            assert reply["outcome"] == "ok" and reply["finite"], reply
        return d / "ckpt", ref

    return make
