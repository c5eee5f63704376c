"""A separate process that loads untrusted checkpoints for the tests, so that a crash in native code (a segfault, an
abort) fails the one test that caused it instead of killing the test run.

Protocol: one JSON job per stdin line, one JSON reply per stdout line (after a ``READY`` line at start-up).
- ``{"op": "load", "path": P, "quant": M|null, "ref": F|null, "save": F|null, "dtype": D|null}``:
  ``moeq.load(P, quant=M, dtype=torch.D)``, then a
  prefill forward and two greedy decode steps (the native decode kernels); their logits are compared with ``ref``
  (exactly) and/or saved to ``save``. Reply ``{"outcome": "ok"|"error"|"bug", ...}``: "error" is a MoeqError (its
  message in ``msg``), "bug" any other exception (type, message, traceback).
- ``{"op": "cli", "argv": [...]}``: ``moeq.cli.main(argv)``; reply ``{"outcome": "cli", "rc": int, "err": str}``
  (an exception escaping ``main`` is a "bug").
"""
from __future__ import annotations

import contextlib
import faulthandler
import io
import json
import sys
import traceback

import torch

faulthandler.enable()  # a crash prints the native stack to stderr, which the test shows


def logits_of(model) -> torch.Tensor:
    vocab = model.config.get_text_config().vocab_size
    ids = (torch.arange(6).unsqueeze(0) * 7 + 3) % vocab
    out = model.generate(ids, max_new_tokens=3, do_sample=False, output_logits=True, return_dict_in_generate=True,
                         pad_token_id=0)
    first = model(ids).logits.float()
    return torch.cat([first[0, -1:], *[x.float() for x in out.logits]])


def load_job(job: dict) -> dict:
    import moeq

    try:
        dtype = getattr(torch, job["dtype"]) if job.get("dtype") else None
        model = moeq.load(job["path"], quant=job.get("quant"), progress=False, dtype=dtype)
        logits = logits_of(model)
    except moeq.MoeqError as e:
        return {"outcome": "error", "msg": str(e)}
    reply = {"outcome": "ok", "finite": bool(torch.isfinite(logits).all())}
    if job.get("save"):
        torch.save(logits, job["save"])
    if job.get("ref"):
        ref = torch.load(job["ref"])
        reply["equal"] = bool(ref.shape == logits.shape and torch.equal(ref, logits))
    return reply


def cli_job(job: dict) -> dict:
    from moeq.cli import main

    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            rc = main(job["argv"])
        except SystemExit as e:  # argparse
            rc = e.code
    return {"outcome": "cli", "rc": rc, "err": err.getvalue()[-4000:], "out": out.getvalue()[-4000:]}


def serve() -> None:
    import logging
    import resource

    # a hostile file must not be able to eat the machine: past this, allocations fail (MemoryError: a "bug" reply)
    limit = 8 << 30
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    logging.disable(logging.WARNING)
    print("READY", flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        try:
            reply = cli_job(job) if job["op"] == "cli" else load_job(job)
        except Exception as e:  # noqa: BLE001 - anything but MoeqError escaping moeq is what the tests look for
            reply = {"outcome": "bug", "type": type(e).__name__, "msg": str(e)[:2000],
                     "traceback": traceback.format_exc()[-4000:]}
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    serve()
