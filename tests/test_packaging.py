"""The package as users install it: a built wheel holds every file moeq needs (the native kernels' C sources
included), and a non-editable install of it into a fresh venv runs through the native kernels (quantize, generate,
save, reload)."""
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SMOKE = """
import sys, torch, moeq
from moeq import native
assert moeq.__file__.startswith(sys.argv[1]), moeq.__file__  # the installed wheel, not the source tree
assert native.lib() is not None, "the native kernels did not build from the installed sources"
from moeq.tiny import make_checkpoint
src = make_checkpoint("qwen3_moe", sys.argv[2] + "/src")
m = moeq.load(src, quant="rtn-int4", progress=False)
out = m.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, do_sample=False)
moeq.save(m, sys.argv[2] + "/q", source=src)
m2 = moeq.load(sys.argv[2] + "/q", progress=False)
assert torch.equal(m2.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, do_sample=False), out)
print("ok", moeq.__version__)
"""


@pytest.mark.packaging
def test_wheel_installs_and_runs_native(tmp_path):
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(dist)], check=True, capture_output=True, cwd=tmp_path)
    (wheel,) = dist.glob("moeq-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    src_files = {str(p.relative_to(ROOT / "src")) for p in (ROOT / "src" / "moeq").rglob("*")
                 if p.is_file() and p.suffix in (".py", ".c", ".h")}
    assert src_files <= names, sorted(src_files - names)
    assert {"moeq/native/csrc/moeq.h", "moeq/native/csrc/moe.c"} <= names
    # a fresh venv (no pip of its own, no editable moeq): the wheel installed into it, non-editable; the heavy
    # dependencies come from this environment's site-packages through a .pth file (not a site dir of its own, so
    # this environment's editable-install hooks are not processed there)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, capture_output=True)
    py = venv / "bin" / "python"
    fresh_site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                     check=True, capture_output=True, text=True).stdout.strip())
    deps = [p for p in sys.path if p.endswith("site-packages") and Path(p).is_dir()]
    (fresh_site / "_deps.pth").write_text("\n".join(deps) + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "-q", str(wheel)],
                   check=True, capture_output=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["XDG_CACHE_HOME"] = str(tmp_path / "cache")  # a fresh kernel build from the installed sources
    r = subprocess.run([str(py), "-c", SMOKE, str(fresh_site), str(tmp_path)], env=env, capture_output=True,
                       text=True, cwd=tmp_path, timeout=600)
    assert r.returncode == 0 and r.stdout.startswith("ok"), r.stderr[-3000:]
