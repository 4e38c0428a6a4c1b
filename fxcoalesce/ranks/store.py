"""The agreement's keys in the default group's c10d store, and their I/O (``agreement`` runs the
protocol over them). Store calls only: never a collective, so nothing here pairs with a
peer's data collective.

Under ``fxcoalesce/agree/v2/<restart>/``: ``<D>/p/<rank>`` a rank's first proposal for
program key D (never overwritten); ``<D>/d`` the register of decision entries (a JSON list,
extended by compare-and-set); ``log/<rank>`` every graph a rank proposed and every function
Dynamo compiled or runs uncompiled there, each with where it starts in each group's stream;
``waits/<rank>`` the key a rank waits on, for whom; ``pid/<rank>`` where it runs; ``ids`` the
tag-id counter.
"""

from __future__ import annotations

import json
import os
import socket

NAMESPACE = "fxcoalesce/agree/v2"
RESERVED_ID = 2 ** 16 - 1
"""The tag id a run Dynamo leaves uncompiled sends (``hooks``): no decision has it."""


def namespace() -> str:
    return f"{NAMESPACE}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


class Store:
    """This process's view of the agreement keys in one store."""

    def __init__(self, store, rank: int, ns: str | None = None):
        self.store, self.rank, self.ns = store, rank, ns or namespace()
        self.floor = 0
        """The largest tag id this process used in an earlier store: ids here start past it."""
        self._joined = False

    def key(self, *parts) -> str:
        return "/".join([self.ns, *map(str, parts)])

    def get(self, key: str):
        return json.loads(self.store.get(key)) if self.store.check([key]) else None

    def new_id(self) -> int:
        """A tag id no other decision in this store has (1 .. RESERVED_ID - 1)."""
        key = self.key("ids")
        if not self._joined:
            self.store.add(key, self.floor)
            self._joined = True
        return (self.store.add(key, 1) - 1) % (RESERVED_ID - 1) + 1

    def propose(self, d: str, proposal: dict) -> dict:
        """Publish this rank's first proposal for ``d``; returns the one there if any."""
        got = self.store.compare_set(self.key(d, "p", self.rank), "", json.dumps(proposal))
        return json.loads(got.decode())

    def proposal(self, d: str, rank: int) -> dict | None:
        return self.get(self.key(d, "p", rank))

    def entries(self, d: str) -> list[dict]:
        return self.get(self.key(d, "d")) or []

    def add(self, d: str, entry: dict) -> list[dict]:
        """Append ``entry`` to the register unless an entry already names one of its ranks
        (then the register as it is). Compare-and-set, retried: never loses an entry."""
        key = self.key(d, "d")
        while True:
            raw = self.store.get(key).decode() if self.store.check([key]) else ""
            current = json.loads(raw) if raw else []
            if any(set(e["ranks"]) & set(entry["ranks"]) for e in current):
                return current
            new = json.dumps(current + [entry])
            if self.store.compare_set(key, raw, new).decode() == new:
                return current + [entry]

    def note(self, line: dict) -> None:
        """A line of this rank's log: a graph it proposed (``{"d", "pos", "cut"}``, then what
        it issues, ``{"d", "pos", "m"}``) or a frame Dynamo is done with (``{"fam", "pos",
        "how"}``, how: "skipped" or "compiled"); ``pos``: where it stands in each group."""
        self.store.append(self.key("log", self.rank), json.dumps(line) + "\n")

    def notes(self, rank: int) -> list[dict]:
        key = self.key("log", rank)
        if not self.store.check([key]):
            return []
        return [json.loads(x) for x in self.store.get(key).decode().splitlines() if x]

    def waits(self, d: str | None, missing: list[int] = ()) -> None:
        """This rank waits on key ``d`` for ``missing``'s proposals (None: no longer)."""
        self.store.set(self.key("waits", self.rank), json.dumps([d, list(missing)]))

    def waiting(self, rank: int) -> tuple[str | None, list[int]]:
        got = self.get(self.key("waits", rank))
        return (got[0], got[1]) if got else (None, [])

    def announce(self) -> None:
        """Say where this rank runs (host, pid): a peer on its host sees its death at once."""
        self.store.set(self.key("pid", self.rank),
                       json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))

    def gone(self, rank: int) -> str | None:
        """Why ``rank``'s process has ended, or None when it may still run."""
        where = self.get(self.key("pid", rank))
        if where and where["host"] == socket.gethostname() and not _alive(where["pid"]):
            return f"its process {where['pid']} is gone"
        return None


def _alive(pid: int) -> bool:
    """Is process ``pid`` running on this host (a zombie is not)?"""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: it exists
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:  # no /proc: as far as can be told, alive
        return True
