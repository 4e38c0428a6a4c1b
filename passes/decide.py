"""Merge or not: what the cost model predicts for a group of mutually independent
all_reduces, issued as one or separately (each hidden behind the compute of its window).

    separate: sum over members of T(member) - hidden(T(member), compute in [ready, need])
    merged:   T(merged bytes) - hidden(T(merged), compute in [last ready, first need])

(``CostModel.hidden_us``: the overlap efficiency times the smaller of the two.)

A merged collective starts when its last member's input is ready and must finish before its
first member's consumer, so merging can expose a collective that separately would have been
hidden. With the ``lower`` pass on, T is the best implementation's for each size
(``fxcoalesce.lowering``: two 256 KB one-shots may beat one 512 KB NCCL call), and the same
predictions choose each remaining all_reduce's implementation (:meth:`Decider.lower`).
Merging is the default: another choice must save more than ``MIN_SAVING_US`` and
``MIN_SAVING_SHARE`` of the merged prediction (estimates are rough; near-ties keep the
fewer launches, and fewer bytes for sums).

Compute estimates come from this rank's graph, and ranks' graphs can differ, so decisions that
read them are local guesses: ranks compare the collectives they lead to (``agreement``).
Without ``cfg.slack_aware`` every group merges and implementations are compared by their
whole time, which reads no compute.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from fxcoalesce.analysis import Analysis, BlockInfo
from fxcoalesce.collectives import Key, group_setup
from fxcoalesce.config import Config
from fxcoalesce.cost import Roofline, compute_prefix, graph_device
from fxcoalesce.lowering import SYMM_IMPLS, exposed_us, options


MIN_SAVING_US = 1.0
MIN_SAVING_SHARE = 0.10


@dataclass(slots=True)
class Decider:
    """Predictions over one analysed graph; ``choose`` is called per candidate group."""

    analysis: Analysis
    cfg: Config
    world: int
    backend: str | None
    prefix: list[float]
    """``cost.compute_prefix`` of the analysis, made here, before any rewrite reads it (kept
    with the analysis: a decider over an analysis reused for an unchanged graph shares it)."""
    impls: tuple[str, ...]

    @classmethod
    def of(cls, analysis: Analysis, cfg: Config) -> Decider:
        roof = Roofline.of(cfg.cost, graph_device(analysis))
        world, backend = group_setup(analysis.scan)
        impls = ("nccl", *SYMM_IMPLS) if "lower" in cfg.enabled_passes else ("nccl",)
        return cls(analysis, cfg, world or 2, backend, compute_prefix(analysis, roof), impls)

    def _window(self, ready: int, need: int) -> float:
        """Predicted compute (µs) between position ``ready`` and ``need``."""
        return self.prefix[need] - self.prefix[ready + 1] if need > ready + 1 else 0.0

    def costs(self, key: Key, nbytes: int, ready: int, need: int
              ) -> tuple[dict[str, float], dict[str, str]]:
        """(implementation -> predicted exposed µs, implementation -> why ruled out) for one
        all_reduce. The compute in its window counts only with ``slack_aware`` (it is this
        rank's estimate); without, implementations are compared by their whole time."""
        totals, why = options(key, nbytes, self.world, self.backend, self.cfg, self.impls)
        window = self._window(ready, need) if self.cfg.slack_aware else 0.0
        return {i: exposed_us(i, us, window, self.cfg, nbytes) for i, us in totals.items()}, why

    def exposed(self, members: list[BlockInfo], nbytes: int | None = None) -> float:
        """Predicted exposed µs of ``members`` issued as one collective of ``nbytes`` (or
        separately, when ``nbytes`` is None), each with its best implementation."""
        best = lambda n, ready, need: min(  # noqa: E731
            self.costs(members[0].block.key, n, ready, need)[0].values())
        if nbytes is None:
            return sum(best(m.block.nbytes, m.ready, m.need) for m in members)
        ready, need = max(m.ready for m in members), min(m.need for m in members)
        return best(nbytes, ready, need)

    def lower(self, info: BlockInfo) -> tuple[str, dict]:
        """(the implementation for ``info``'s all_reduce, a record for the report). Another
        than NCCL must save more than ``MIN_SAVING_US`` and ``MIN_SAVING_SHARE`` of NCCL's
        prediction: near-ties keep NCCL, which plain torch.compile runs."""
        b = info.block
        costs, why = self.costs(b.key, b.nbytes, info.ready, info.need)
        nccl = costs["nccl"]
        best = min(costs, key=costs.__getitem__)
        margin = max(MIN_SAVING_US, MIN_SAVING_SHARE * nccl)
        chosen = best if costs[best] < nccl - margin else "nccl"
        return chosen, {"members": [b.collective.name], "chose": chosen, "bytes": b.nbytes,
                        "predicted_exposed_us": {i: round(v, 2) for i, v in costs.items()},
                        "ruled_out": why, "local": self.cfg.slack_aware}

    def choose(self, members: list[BlockInfo], merged_bytes: Callable[[list[BlockInfo]], int]
               ) -> tuple[list[BlockInfo], dict]:
        """(the members to merge — all, some or none —, a record for the report).
        ``merged_bytes(subset)`` is the size of the collective that would replace ``subset``."""
        separate = self.exposed(members)
        options = [(self.exposed(members, merged_bytes(members)), members)]
        if self.cfg.slack_aware:
            # members whose window covers them may do better apart from the rest
            alone = [m for m in members if self._window(m.ready, m.need)
                     >= self.cfg.cost.all_reduce_us(m.block.nbytes, self.world)]
            rest = [m for m in members if m not in alone]
            if alone and len(rest) > 1:
                options.append((self.exposed(rest, merged_bytes(rest)) + self.exposed(alone),
                                rest))
            options.append((separate, []))
        merged_us = options[0][0]
        margin = max(MIN_SAVING_US, MIN_SAVING_SHARE * merged_us)
        best_us, chosen = min([options[0]] + [o for o in options[1:] if o[0] < merged_us - margin],
                              key=lambda o: o[0])
        record = {"members": [m.block.collective.name for m in members],
                  "chose": ("merge all" if len(chosen) == len(members) else
                            "separate" if not chosen else f"merge {len(chosen)} of {len(members)}"),
                  "predicted_exposed_us": {"chosen": round(best_us, 2),
                                           "merged": round(options[0][0], 2),
                                           "separate": round(separate, 2)},
                  "local": self.cfg.slack_aware}
        return chosen, record
