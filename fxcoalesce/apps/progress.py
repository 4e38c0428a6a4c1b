"""Progress on stderr for work that takes minutes: what runs, on how many ranks, time so far.

    with Phase(say, "compiling the speculative step on 2 ranks"):
        step(...)                      # first call: Dynamo, AOTAutograd, the passes
    # compiling the speculative step on 2 ranks ...
    #   still compiling the speculative step on 2 ranks, 10 s
    #   done in 31.2 s

    with Phase(say, "decoding greedily", total=64, unit="tokens") as p:
        for ...: p.advance()           # a bar on a terminal, a line every HEARTBEAT_S else

No silence longer than ``HEARTBEAT_S`` while a phase lasts: a thread prints "still ..." (a
compile holds the interpreter in long stretches of Python, which still lets a thread run
between bytecodes). ``say`` None makes every phase silent (``-q``, ranks but the first).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable

HEARTBEAT_S = float(os.environ.get("FXCOALESCE_HEARTBEAT_S", "8"))
"""Seconds between "still ..." lines (FXCOALESCE_HEARTBEAT_S changes it, e.g. for tests): 8,
so that no silence passes 10 s where Dynamo holds the interpreter past a tick (10 gave one
gap of 10.5 s tracing the Kimi-K2 verify step at TP 8)."""
BAR_WIDTH = 24


def stderr_say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def duration(seconds: float) -> str:
    """'42 s', '2m10s', '1h03m'."""
    s = int(seconds)
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def bar(done: int, total: int, width: int = BAR_WIDTH) -> str:
    """'[#########...............] 24/64'."""
    filled = min(width, width * done // max(total, 1))
    return f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total}"


class Phase:
    """Says ``what ...`` on entry, "still <what>, <time>" every ``every`` seconds while it
    lasts, and "done in X s" (``done`` replaces the words; "" says nothing) on exit, each
    line after ``prefix``, the later ones indented by ``indent`` (``announce`` False: no
    first line, where the caller said it already). With ``total``,
    :meth:`advance` counts ``unit`` toward it: on a terminal a bar redrawn in place, else
    the count in each heartbeat line. ``say`` None: nothing at all."""

    def __init__(self, say: Callable[[str], None] | None, what: str, *,
                 total: int | None = None, unit: str = "", every: float | None = None,
                 done: str = "done", prefix: str = "", indent: str = "  ",
                 announce: bool = True, stream=None):
        self.say, self.what, self.total, self.unit = say, what, total, unit
        self.every = HEARTBEAT_S if every is None else every
        self.done_words, self.prefix, self.indent = done, prefix, indent
        self.announce = announce
        self.count = 0
        self.seconds = 0.0
        self._stream = stream or sys.stderr
        self._live = bool(say) and total is not None and _is_terminal(self._stream)
        self._drawn = 0.0
        self._lock = threading.Lock()  # the bar is drawn by the caller and the heartbeat
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Phase:
        self._t0 = time.perf_counter()
        if self.say:
            if self._live:
                self._draw(force=True)
            elif self.announce:
                self.say(f"{self.prefix}{self.what} ...")
            self._thread = threading.Thread(target=self._beat, daemon=True)
            self._thread.start()
        return self

    def elapsed(self) -> float:
        return time.perf_counter() - self._t0

    def advance(self, n: int = 1) -> None:
        self.count += n
        if self._live:
            self._draw()

    def _progress(self) -> str:
        if self.total is None:
            return ""
        return f", {self.count}/{self.total}{' ' + self.unit if self.unit else ''}"

    def _draw(self, force: bool = False) -> None:
        now = time.perf_counter()
        if not force and now - self._drawn < 0.25 and self.count < (self.total or 0):
            return
        with self._lock:
            self._drawn = now
            unit = f" {self.unit}" if self.unit else ""
            self._stream.write(f"\r{self.prefix}{self.what} {bar(self.count, self.total)}"
                               f"{unit}, {duration(self.elapsed())}\x1b[K")
            self._stream.flush()

    def _beat(self) -> None:
        while not self._stop.wait(self.every if not self._live else 1.0):
            if self._live:
                self._draw(force=True)
            else:
                self.say(f"{self.prefix}{self.indent}still {self.what}, "
                         f"{duration(self.elapsed())}{self._progress()}")

    def __exit__(self, kind, value, tb) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.seconds = self.elapsed()
        if not self.say:
            return
        if self._live:
            self._draw(force=True)
            self._stream.write("\n")
            self._stream.flush()
        if kind is None and self.done_words:
            self.say(f"{self.prefix}{self.indent}{self.done_words} in {self.seconds:.1f} s")


def _is_terminal(stream) -> bool:
    try:
        return stream.isatty() and os.environ.get("TERM") != "dumb"
    except (AttributeError, ValueError):
        return False


def first_call_announced(fn: Callable, say: Callable[[str], None] | None, what: str,
                         **phase) -> Callable:
    """``fn`` whose first call (a compiled function's compile) runs inside
    ``Phase(say, what)``; later calls go straight through."""
    pending = [True]

    def call(*args, **kwargs):
        if pending:
            pending.clear()
            with Phase(say, what, **phase):
                return fn(*args, **kwargs)
        return fn(*args, **kwargs)

    return call
