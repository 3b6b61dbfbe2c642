"""The colocation benchmark's plot: the online latency's distribution and the offline job's
progress, one colour per mode (matplotlib, from the ``bench`` extra)."""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from pathlib import Path

from bench.baselines import in_order
from bench.colocation_plan import Repetition
from bench.colocation_report import percentile


def plot(reps: Sequence[Repetition], path: Path, title: str) -> None:
    """Online latency CDFs and offline progress over time, one colour per mode."""
    try:
        import matplotlib
    except ImportError:
        print("no plot: matplotlib is missing (pip install -e '.[bench]')")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedFormatter, FixedLocator, NullLocator

    colours = {"unmanaged": "tab:red", "static": "tab:orange", "kubelet-memoryqos": "tab:olive",
               "agent-creation": "tab:cyan", "agent": "tab:blue"}
    spare = iter(("tab:purple", "tab:green", "tab:brown", "tab:pink", "black"))
    colours |= {m: next(spare, "tab:gray") for m in in_order(r.mode for r in reps)
                if m not in colours}
    fig, (cdf, progress) = plt.subplots(1, 2, figsize=(12, 4.8))
    for mode, colour in colours.items():
        lat = sorted(v for r in reps if r.mode == mode for v in r.latencies_ms)
        if not lat:
            continue
        n = len(lat)
        # A point per distinct rank, thinned where the curve is flat (the bulk).
        ranks = sorted({*range(0, n, max(n // 2000, 1)), *range(max(n - 2000, 0), n)})
        cdf.plot([lat[i] for i in ranks], [(i + 0.5) / n for i in ranks], color=colour,
                 label=f"{mode} (p99 {percentile(lat, 0.99):.2f} ms)")
        for r in (r for r in reps if r.mode == mode):
            xs, ys = zip(*r.progress, strict=True)
            progress.plot(xs, [y / 1024 for y in ys], color=colour, alpha=0.7,
                          label=mode if r.index == min(x.index for x in reps
                                                       if x.mode == mode) else None)
            # where the agent squeezed the offline tier, on that repetition's line
            squeezes = [t for t, what in r.events if what.startswith("squeeze")]
            if squeezes:
                at = [bisect.bisect_right(xs, t) - 1 for t in squeezes]
                progress.plot(squeezes, [ys[max(i, 0)] / 1024 for i in at], "v", color=colour,
                              markersize=6, label="squeeze (limit written)"
                              if r is next(x for x in reps if x.events) else None)
    alone = sorted(v for r in reps for v in r.alone_ms)
    if alone:
        n = len(alone)
        cdf.plot(alone, [(i + 0.5) / n for i in range(n)], color="tab:gray", linestyle=":",
                 label=f"online alone (p99 {percentile(alone, 0.99):.2f} ms)")
    cdf.set_xscale("log")
    # logit: the tail (p99, p99.9) gets as much room as the body
    cdf.set_yscale("logit")
    cdf.set_ylim(0.01, 0.9999)
    ticks = [0.01, 0.1, 0.5, 0.9, 0.99, 0.999, 0.9999]
    cdf.yaxis.set_major_locator(FixedLocator(ticks))
    cdf.yaxis.set_major_formatter(FixedFormatter([f"p{100 * t:g}" for t in ticks]))
    cdf.yaxis.set_minor_locator(NullLocator())
    cdf.set_xlabel("online iteration latency (ms)")
    cdf.set_ylabel("share of iterations at or below (percentile)")
    cdf.grid(True, which="both", alpha=0.3)
    cdf.legend(loc="lower right")
    cdf.set_title("online latency (CDF)")
    progress.set_xlabel("seconds since the offline pod started")
    progress.set_ylabel("offline data processed (GiB read + written)")
    progress.grid(True, alpha=0.3)
    progress.legend(loc="upper left")
    progress.set_title("offline progress (one line per repetition)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"plot: {path}")
