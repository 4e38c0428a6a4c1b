"""The piecewise alpha-beta fit of measured all_reduce times (``fxcoalesce calibrate``).

    segments = fit({bytes: µs, ...})        # [{"up_to_bytes", "alpha_us", "beta_us_per_byte"}]
    segments, rows, worst = fit_rows(points)  # and each point measured / predicted / error

Fewest segments whose worst relative error is under 10% (else the best of up to 4), least
squares on relative error refined to the smallest worst error; ``CostModel.from_profile``
reads the segments back (``fxcoalesce.config``). Plain Python: no torch.
"""

from __future__ import annotations

import itertools
import math
import statistics


def _line(points: list[tuple[int, float]]) -> tuple[float, float]:
    """alpha, beta >= 0 minimising the squared relative error of alpha + beta * bytes."""
    # rows [1/m, b/m] . [alpha, beta] ~ 1: 2x2 normal equations
    s11 = sum(1 / m**2 for _, m in points)
    s12 = sum(b / m**2 for b, m in points)
    s22 = sum(b * b / m**2 for b, m in points)
    r1, r2 = sum(1 / m for _, m in points), sum(b / m for b, m in points)
    det = s11 * s22 - s12 * s12
    if len(points) < 2 or det <= 0:
        return statistics.median(m for _, m in points), 0.0
    alpha, beta = (r1 * s22 - r2 * s12) / det, (s11 * r2 - s12 * r1) / det
    if beta < 0:
        return statistics.median(m for _, m in points), 0.0
    if alpha < 0:  # through the origin
        return 0.0, r2 / s22
    return alpha, beta


def _minimax(points: list[tuple[int, float]], alpha: float, beta: float
             ) -> tuple[float, float]:
    """Refine a least-squares line to shrink its worst relative error: alternate 1-D searches
    on alpha and beta (the worst error is convex in each), keeping both >= 0."""
    worst = lambda a, b: max(abs(a + b * x - m) / m for x, m in points)  # noqa: E731

    def search(f, lo, hi):
        for _ in range(60):
            m1, m2 = lo + (hi - lo) / 3, hi - (hi - lo) / 3
            lo, hi = (lo, m2) if f(m1) <= f(m2) else (m1, hi)
        return (lo + hi) / 2

    top = max(m for _, m in points)
    for _ in range(4):
        alpha = search(lambda a: worst(a, beta), 0.0, 2 * top)
        span = max(beta * 4, top / max(x for x, _ in points))
        beta = search(lambda b: worst(alpha, b), 0.0, span)
    return alpha, beta


def _max_error(segments, points) -> float:
    return max(abs(_predict(segments, b) - m) / m for b, m in points)


def _predict(segments: list[dict], nbytes: int) -> float:
    seg = next((s for s in segments if nbytes <= s["up_to_bytes"]), segments[-1])
    return seg["alpha_us"] + seg["beta_us_per_byte"] * nbytes


def fit(points: dict[int, float], max_segments: int = 4) -> list[dict]:
    """Piecewise alpha-beta with the fewest segments whose worst relative error is under 10%
    (else the best of up to ``max_segments``); breakpoints at measured sizes. Candidate
    breakpoints are ranked by least squares; the best few are refined to minimax."""
    pts = sorted(points.items())

    def segs(cuts, refine=False):
        bounds = [0, *cuts, len(pts)]
        out = []
        for lo, hi in zip(bounds, bounds[1:]):
            a, b = _line(pts[lo:hi])
            if refine:
                a, b = _minimax(pts[lo:hi], a, b)
            out.append({"up_to_bytes": pts[hi - 1][0], "alpha_us": a, "beta_us_per_byte": b})
        return out

    best = segs([], refine=True)
    for k in range(1, max_segments):
        if _max_error(best, pts) < 0.10:
            break
        ranked = sorted(_cut_choices(len(pts), k), key=lambda c: _max_error(segs(c), pts))
        for cuts in ranked[:8]:
            cand = segs(list(cuts), refine=True)
            if _max_error(cand, pts) < _max_error(best, pts):
                best = cand
    return best


def _cut_choices(n: int, k: int, min_len: int = 3):
    """Increasing breakpoints leaving at least ``min_len`` points per segment."""
    for cuts in itertools.combinations(range(min_len, n - min_len + 1), k):
        if all(b - a >= min_len for a, b in zip(cuts, cuts[1:])):
            yield cuts


def fit_rows(points: dict[int, float]) -> tuple[list[dict], list[dict], float]:
    """(segments, one row per size: measured, predicted and relative error, the worst error
    from 1 KB to 16 MB, NaN when no size is in that range) for ``points`` {bytes: µs}."""
    segments = fit(points)
    rows = [{"bytes": b, "measured_us": round(m, 2),
             "predicted_us": round(_predict(segments, b), 2),
             "error": round((_predict(segments, b) - m) / m, 4)}
            for b, m in sorted(points.items())]
    in_range = [abs(r["error"]) for r in rows if 1024 <= r["bytes"] <= 16 << 20]
    return segments, rows, max(in_range, default=math.nan)
