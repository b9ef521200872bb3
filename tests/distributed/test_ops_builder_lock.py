"""A build killed mid-way never blocks the next one: torch's lock file, which torch
waits on for as long as it exists, is removed at once when no live ds_odc build holds the builder's kernel
lock; a live build is waited for; a library a killed link left truncated is built again. Runs the CPU
operator (ds_odc_atomics, a one-second g++ build) in fresh processes with their own extensions folder."""
import os
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

LOAD = """
import json, time
import ds_odc.ops_builder as ob
start = time.monotonic()
ob.load_op(ob.ATOMICS)
lock = (ob.build_directory(ob.ATOMICS) / "lock").exists()
print("LOADED " + json.dumps({"seconds": time.monotonic() - start, "torch_lock": lock}))
"""

HOLD = """
import sys, time
import ds_odc.ops_builder as ob
directory = ob.build_directory(ob.ATOMICS)
directory.mkdir(parents=True, exist_ok=True)
with ob._builder_lock(directory, ob.ATOMICS):
    (directory / "lock").write_text("")   # as torch's baton, mid-build
    print("HOLDING", flush=True)
    time.sleep(float(sys.argv[1]))
"""


def _env(tmp_path):
    return {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"), "DS_ACCELERATOR": "cpu",
            "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _load(tmp_path, timeout=120):
    done = subprocess.run([sys.executable, "-c", LOAD], env=_env(tmp_path), capture_output=True, text=True,
                          timeout=timeout, cwd=str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("LOADED "))
    import json

    return json.loads(line[7:])


def _holder(tmp_path, seconds):
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(seconds)], env=_env(tmp_path), stdout=subprocess.PIPE,
                              text=True, cwd=str(tmp_path))
    assert holder.stdout.readline().strip() == "HOLDING"
    return holder


def test_a_build_killed_mid_way_leaves_no_lock_that_blocks_the_next(tmp_path):
    holder = _holder(tmp_path, 600)
    holder.send_signal(signal.SIGKILL)  # killed mid-build: torch's lock file stays, young
    holder.wait()
    loaded = _load(tmp_path, timeout=60)  # before the fix: waited on the lock file for 30 minutes
    assert not loaded["torch_lock"]


def test_a_live_build_is_waited_for_not_broken(tmp_path):
    holder = _holder(tmp_path, 3)
    start = time.monotonic()
    loaded = _load(tmp_path)
    assert holder.wait(timeout=30) == 0
    assert time.monotonic() - start >= 2.5, "the loader did not wait for the live build"
    assert not loaded["torch_lock"]


def test_a_truncated_library_is_built_again(tmp_path):
    first = _load(tmp_path)
    assert not first["torch_lock"]
    code = "import ds_odc.ops_builder as ob; print(ob._library_path(ob.ATOMICS))"
    path = subprocess.run([sys.executable, "-c", code], env=_env(tmp_path), capture_output=True, text=True,
                          check=True).stdout.strip()
    with open(path, "wb") as library:
        library.write(b"\x7fELF truncated")
    _load(tmp_path)
    assert os.path.getsize(path) > 1000
