"""``apps.progress``: what long work says while it runs (no silence longer than a heartbeat)."""

import io
import re
import time

from fxcoalesce.apps.progress import Phase, bar, duration, first_call_announced


def test_duration_and_bar():
    assert [duration(s) for s in (0.4, 42, 130, 3725)] == ["0 s", "42 s", "2m10s", "1h02m"]
    assert bar(16, 64, width=8) == "[##......] 16/64"
    assert bar(70, 64, width=8) == "[########] 70/64"


def wait_for(lines: list, n: int) -> None:
    """Until ``lines`` has ``n`` lines (a busy machine delays the heartbeat's thread: no
    count of beats per second is asserted)."""
    end = time.monotonic() + 60
    while len(lines) < n and time.monotonic() < end:
        time.sleep(0.01)


def test_a_phase_says_what_runs_then_still_then_done():
    lines = []
    with Phase(lines.append, "compiling the speculative step on 2 ranks", every=0.05,
               prefix="  "):
        wait_for(lines, 3)
    assert lines[0] == "  compiling the speculative step on 2 ranks ..."
    beats = lines[1:-1]
    assert len(beats) >= 2, lines
    assert all(b.startswith("    still compiling the speculative step on 2 ranks, ")
               for b in beats), beats
    assert lines[-1].startswith("    done in 0.")


def test_a_phase_with_a_length_counts_in_its_heartbeats():
    lines = []
    with Phase(lines.append, "decoding greedily", total=64, unit="tokens", every=0.05,
               done="") as p:
        p.advance(10)
        wait_for(lines, 2)
    assert any(ln.endswith(", 10/64 tokens") for ln in lines[1:]), lines
    assert not lines[-1].startswith("  done")  # done="": no closing line


def test_a_bar_on_a_terminal():
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    term, lines = Terminal(), []
    with Phase(lines.append, "timing", total=4, unit="rounds", stream=term, done="") as p:
        for _ in range(4):
            p.advance()
    drawn = term.getvalue()
    assert drawn.startswith("\rtiming [") and drawn.endswith("\n"), drawn
    assert re.search(r"\] 4/4 rounds, \d+ s\x1b\[K\n$", drawn), drawn
    assert lines == []  # the bar replaces the lines


def test_silent_without_say_and_after_an_error():
    with Phase(None, "anything", every=0.01):
        time.sleep(0.03)  # no thread, nothing printed, nothing raised (nothing to wait for)
    lines = []
    try:
        with Phase(lines.append, "compiling", every=10):
            raise KeyError("x")
    except KeyError:
        pass
    assert lines == ["compiling ..."]  # no "done" after a failure


def test_first_call_announced():
    lines, calls = [], []
    fn = first_call_announced(lambda x: calls.append(x) or x * 2, lines.append,
                              "compiling the step")
    assert [fn(1), fn(2), fn(3)] == [2, 4, 6] and calls == [1, 2, 3]
    assert lines[0] == "compiling the step ..." and lines[1].startswith("  done in ")
    assert len(lines) == 2  # the later calls go straight through
