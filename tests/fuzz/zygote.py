"""Rank processes forked from interpreters that imported torch once (``runner``'s default on
platforms with ``fork``; ``FXFUZZ_SPAWN=exec`` runs ``python program.py`` per rank instead).

A fresh rank spends about 3.5 s of CPU importing torch, Dynamo and Inductor before its
program starts: with four variants and two to four ranks per program, most of a fuzz
program's time on two cores. A zygote is ``python zygote.py``: it imports ``PRELOAD``, then
reads requests on stdin (one JSON line each: script, cwd, env, stdout, stderr files), forks
a child per request and answers ``{"id", "pid"}``; when a child ends it answers ``{"pid",
"returncode"}`` (``-N`` for signal N, as ``subprocess`` reports it). The child is what
``python script.py`` would be, but for the imports already made: a new session, the
environment replaced, its own stdout/stderr files, ``sys.argv``/``sys.path[0]`` of the
script, ``random`` reseeded, the script run as ``__main__``, atexit handlers at the end.

What a fork cannot give is a fresh hash seed (``PYTHONHASHSEED``), and rank-divergent set
orders are bugs the fuzzer should see: rank ``r`` of a program forks from zygote ``r``
(separate interpreters, separate seeds), and a zygote is retired after ``FORKS`` children
(a new one, a new seed). Only the imports, never fxcoalesce: plain must stay plain.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading
from pathlib import Path

PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "torch._inductor.compile_fx")
FORKS = 24  # children per zygote before a fresh one (a fresh hash seed)


# --- the zygote process ---------------------------------------------------------------

def _send(msg: dict) -> None:
    os.write(1, (json.dumps(msg) + "\n").encode())


def _child(req: dict) -> None:
    """In the forked child: become ``python req['script']``; never returns."""
    code = 1
    try:
        os.setsid()
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        for fd, name in ((1, "stdout"), (2, "stderr")):
            out = os.open(req[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(out, fd)
            os.close(out)
        import random
        import runpy

        random.seed()
        script = req["script"]
        sys.argv = [script]
        sys.path[0] = str(Path(script).parent)
        try:
            runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if not isinstance(e.code, (int, type(None))):
                print(e.code, file=sys.stderr)
        except BaseException:
            import traceback

            traceback.print_exc()
        import atexit

        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def serve() -> None:
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    _send({"ready": os.getpid()})
    buf, open_in, children = b"", True, set()
    while open_in or children:
        if open_in:
            ready, _, _ = select.select([0], [], [], 0.05)
            if ready:
                data = os.read(0, 1 << 16)
                open_in = bool(data)
                buf += data
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    req = json.loads(line)
                    sys.stdout.flush()
                    pid = os.fork()
                    if pid == 0:
                        _child(req)
                    children.add(pid)
                    _send({"id": req["id"], "pid": pid})
        else:
            select.select([], [], [], 0.05)
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                children.clear()
                break
            if pid == 0:
                break
            children.discard(pid)
            _send({"pid": pid, "returncode": os.waitstatus_to_exitcode(status)})


# --- the runner's side ----------------------------------------------------------------

class Forked:
    """A rank forked by a zygote, with the bit of ``subprocess.Popen`` the runner uses."""

    def __init__(self, pid: int, zygote: _Zygote):
        self.pid, self._z, self.returncode = pid, zygote, None

    def poll(self):
        if self.returncode is None:
            self.returncode = self._z.returncode(self.pid)
        return self.returncode

    def wait(self):
        while self.poll() is None:
            with self._z.changed:
                self._z.changed.wait(0.1)
        return self.returncode


class _Zygote:
    def __init__(self, env: dict):
        self.proc = subprocess.Popen([sys.executable, __file__], env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, start_new_session=True)
        self.lock, self.changed = threading.Lock(), threading.Condition()
        self.pids, self.codes, self.forks, self.next_id = {}, {}, 0, 0
        first = json.loads(self.proc.stdout.readline() or "{}")
        if "ready" not in first:
            raise RuntimeError("fuzz zygote did not start (see its stderr above)")
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            msg = json.loads(line)
            with self.changed:
                if "id" in msg:
                    self.pids[msg["id"]] = msg["pid"]
                else:
                    self.codes[msg["pid"]] = msg["returncode"]
                self.changed.notify_all()

    def fork(self, req: dict) -> Forked:
        with self.lock:
            self.next_id += 1
            self.forks += 1
            rid = self.next_id
            self.proc.stdin.write((json.dumps({**req, "id": rid}) + "\n").encode())
            self.proc.stdin.flush()
        with self.changed:
            if not self.changed.wait_for(lambda: rid in self.pids or self.proc.poll() is not
                                         None, timeout=60) or rid not in self.pids:
                raise RuntimeError("fuzz zygote did not fork")
            return Forked(self.pids.pop(rid), self)

    def returncode(self, pid: int):
        with self.changed:
            return self.codes.pop(pid, None)

    def retire(self) -> None:
        """No more children: it leaves once those it has are reaped."""
        try:
            self.proc.stdin.close()
        except OSError:
            pass


_POOL: dict[int, tuple[str, _Zygote]] = {}
"""One zygote per rank index, with the environment it imported under: one of another
environment replaces it (under pytest, one per test would pile up: 25 replays, 3 ranks each,
~380 MB a zygote filled 24 GiB and the OOM killer took ranks and a worker in CI)."""
_POOL_LOCK = threading.Lock()


def fork(rank: int, script: str, cwd: str, env: dict, stdout: str, stderr: str,
         zygote_env: dict) -> Forked:
    """Rank ``rank``'s process for ``script`` from zygote ``rank`` (started, or replaced after
    ``FORKS`` children, here). ``zygote_env``: the environment the imports see (what every
    run shares: OMP_NUM_THREADS, PYTHONPATH...)."""
    key = json.dumps(sorted(zygote_env.items()))
    with _POOL_LOCK:
        was, z = _POOL.get(rank, (None, None))
        if z is None or was != key or z.forks >= FORKS or z.proc.poll() is not None:
            if z is not None:
                z.retire()
            z = _Zygote(zygote_env)
            _POOL[rank] = key, z
    return z.fork({"script": script, "cwd": cwd, "env": env, "stdout": stdout,
                   "stderr": stderr})


def usable() -> bool:
    return hasattr(os, "fork") and os.environ.get("FXFUZZ_SPAWN", "fork") != "exec"


if __name__ == "__main__":
    serve()
