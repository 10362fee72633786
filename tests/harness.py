"""
The harness the distributed tests share: launch real processes with torchrun on the CPU
(gloo), exactly as a user would, and fail instead of hanging.

    result = torchrun("parallel.py", ["--tp", "2"], nproc=2)
    assert result.returncode == 0, result.output

`sys.executable -m torch.distributed.run` rather than a `torchrun` on PATH, so the
processes use this interpreter and its packages. GLOO_SOCKET_IFNAME=lo: in a sandbox gloo
may fail to pick a network interface on its own.

Hermetic: a script is named relative to the repo (`"train.py"`) and found there, but it
runs in the test session's working folder, a temporary folder that tests/conftest.py moves
the session into. So a script's default outputs (`out/ckpt.pt`, `out/serve/...`) land
there, never in the reader's `out/`.
"""
import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from serving.api_server import make_server

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class Result:
    returncode: int
    output: str          # stdout and stderr together, in order


def in_repo(script):
    """A script named relative to the repo root -> its absolute path (absolute stays)."""
    return os.path.join(ROOT, script)


def script_argv(script):
    """"train.py" -> [its absolute path]; "-m scripts.serve_bench" -> ["-m", the module]
    (an entry point under a folder, run as a module; PYTHONPATH makes the repo importable
    from the temporary working folder, as the repo root does for a reader)."""
    script = str(script)
    if script.startswith("-m "):
        return ["-m", script[3:].strip()]
    return [in_repo(script)]


def python_cmd(script, *args):
    """The argv of `python script args...` (or `python -m module args...`)."""
    return [sys.executable, *script_argv(script), *map(str, args)]


def torchrun_cmd(nproc, script, *args, extra=()):
    """The argv of `torchrun --standalone --nproc_per_node=nproc script args...`.
    extra: more torchrun flags (e.g. --max-restarts=1)."""
    return torchrun_node_cmd(["--standalone", f"--nproc_per_node={nproc}", *extra],
                             script, *args)


def torchrun_node_cmd(launch, script, *args):
    """The argv of one torchrun agent of a multi-node launch: `torchrun LAUNCH... script
    args...`, launch holding its rendezvous flags (--nnodes 2 --node-rank 0 --master-addr
    127.0.0.1 ...; docs/data_parallel.md, "Multi-node"). No --standalone: that would give
    each agent a rendezvous of its own, and the two "nodes" would never meet."""
    return [sys.executable, "-m", "torch.distributed.run", *map(str, launch),
            *script_argv(script), *map(str, args)]


def free_ports(n):
    """n distinct TCP ports free on 127.0.0.1 now (all held open together while the OS picks,
    so no two are the same; free again once returned, for a launch to take)."""
    held = [socket.socket() for _ in range(n)]
    try:
        for s in held:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in held]
    finally:
        for s in held:
            s.close()


def run_python(script, args=(), timeout=120, env=None, cwd=None):
    """`python script args...` (or `python -m module args...`) as a user would type it.
    cwd None: the session's working folder (a temporary one, see the module docstring)."""
    return _run(python_cmd(script, *args), timeout, env, cwd)


def torchrun(script, args=(), nproc=2, timeout=180, env=None, cwd=None, extra=()):
    """`torchrun --standalone --nproc_per_node=nproc script args...` on the CPU."""
    return _run(torchrun_cmd(nproc, script, *args, extra=extra), timeout, env, cwd)


def run_together(cmds, timeout=180, env=None, cwd=None):
    """Independent commands (python_cmd / torchrun_cmd argvs) started at once -> their
    Results, in order. Every test process runs one thread (OMP_NUM_THREADS=1), so a
    one-process reference run alone leaves the second core idle: started beside its
    torchrun twin, the two share the machine instead of waiting for each other. Only for
    runs that share no files: their outputs do not depend on the timing. timeout: for
    all of them together."""
    deadline = time.monotonic() + timeout
    started = [(cmd, _start(cmd, env, cwd)) for cmd in cmds]
    try:
        return [_wait(cmd, p, max(1.0, deadline - time.monotonic())) for cmd, p in started]
    finally:                    # one timed out: the others are not left running behind it
        for _, p in started:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.communicate()


def _run(cmd, timeout, env, cwd):
    return _wait(cmd, _start(cmd, env, cwd), timeout)


def _start(cmd, env, cwd):
    full_env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1",
                "PYTHONUNBUFFERED": "1", **(env or {})}
    full_env.setdefault("PYTHONPATH", ROOT)
    # A session of its own, so a timeout kills torchrun AND the ranks it started (killing
    # only torchrun would leave hung ranks behind, holding ports and CPU).
    return subprocess.Popen(cmd, cwd=cwd, env=full_env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _wait(cmd, p, timeout):
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        raise AssertionError(f"timed out after {timeout:.0f} s: {' '.join(cmd)}\n{out}") from None
    return Result(p.returncode, out)


# ----------------------------------------------------------------------------------------
# serve.py's HTTP server in-process, for the tests that speak the OpenAI protocol to it

@contextlib.contextmanager
def served(engine, enc, model_name):
    """make_server around `engine` on a free port, serving from a thread; shut down after."""
    srv = make_server(engine, enc, "127.0.0.1", 0, model_name=model_name)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield srv
    finally:
        srv.shutdown()
        srv.server_close()
        srv.loop.stop()


def http_json(srv, method, path, body=None):
    """One request with a JSON body -> (status, the JSON answer), or for a server-sent
    event stream (status, [each event's JSON])."""
    conn = http.client.HTTPConnection("127.0.0.1", srv.server_address[1], timeout=60)
    conn.request(method, path, body=json.dumps(body) if body is not None else None,
                 headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    raw = r.read().decode()
    conn.close()
    if r.getheader("Content-Type", "").startswith("text/event-stream"):
        return r.status, [json.loads(line[6:]) for line in raw.splitlines()
                          if line.startswith("data: {")]
    return r.status, json.loads(raw)
