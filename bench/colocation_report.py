"""The colocation benchmark's results: reading the workloads' records and the agent's audit trail,
percentiles, the table, the intervals, the summary line and the raw JSON."""

from __future__ import annotations

import array
import bisect
import dataclasses
import json
import math
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from bench.baselines import bootstrap_interval, in_order, runs_agent
from bench.colocation_plan import Repetition, Settings
from bench.kubelet_node import MIB


def read_pairs(path: Path) -> list[tuple[int, int]]:
    """A workload's records of signed 64-bit pairs (ns), a partial last pair dropped; none when
    the file is absent: the probe's (start, duration), the load generator's (due, latency)
    and its sends' (due, delay)."""
    values = array.array("q")
    if path.exists():
        data = path.read_bytes()
        values.frombytes(data[: len(data) // 16 * 16])
    return list(zip(values[0::2], values[1::2], strict=True))


def read_progress(path: Path, t0_ns: int, t1_ns: int) -> list[tuple[float, float]]:
    points: list[tuple[float, float]] = [(0.0, 0.0)]
    if not path.exists():
        return points
    for line in path.read_text().splitlines():
        fields = line.split()
        if len(fields) < 4:
            continue
        at, read, written = int(fields[0]), int(fields[1]), int(fields[2])
        if at <= t1_ns:
            points.append(((at - t0_ns) / 1e9, (read + written) / MIB))
    return points


def read_work(path: Path, t1_ns: int) -> tuple[float, float]:
    """The offline job's work by ``t1_ns``: MiB checksummed and CPU seconds spent on it."""
    work = (0.0, 0.0)
    if path.exists():
        for line in path.read_text().splitlines():
            fields = line.split()
            if len(fields) == 6 and int(fields[0]) <= t1_ns:
                work = (int(fields[4]) / MIB, int(fields[5]) / 1e9)
    return work


def merge_progress(series: Sequence[Sequence[tuple[float, float]]]) -> list[tuple[float, float]]:
    """Several pods' progress as one: at each time any of them reported, the sum of what each
    had done by then."""
    if len(series) == 1:
        return list(series[0])
    times = sorted({t for points in series for t, _ in points})
    merged = []
    for t in times:
        total = 0.0
        for points in series:
            at = bisect.bisect_right([p[0] for p in points], t) - 1
            total += points[at][1] if at >= 0 else 0.0
        merged.append((t, total))
    return merged


def read_service(path: Path, t0_ns: int, t1_ns: int,
                 timeout_ms: float) -> tuple[list[float], int]:
    """The service's requests due in the window: the latencies (ms, from the due time) of those
    answered within the timeout, and how many were not (missed)."""
    answered, missed = [], 0
    for due, latency in read_pairs(path):
        if not t0_ns <= due < t1_ns:
            continue
        if latency < 0 or latency > timeout_ms * 1e6:
            missed += 1
        else:
            answered.append(latency / 1e6)
    return answered, missed


def tail_percentile(answered_ms: Sequence[float], missed: int, q: float) -> float:
    """The q-quantile (nearest rank) of the latencies of all requests due, a missed request
    counting as infinitely late: a tail that reaches the misses is infinite, never hidden."""
    n = len(answered_ms) + missed
    if not n:
        return math.nan
    rank = max(math.ceil(q * n), 1) - 1
    ordered = sorted(answered_ms)
    return ordered[rank] if rank < len(ordered) else math.inf


def summarize_actions(records: Sequence[tuple[float, str, dict[str, Any]]], start: float,
                      end: float) -> dict[str, int]:
    """What the agent did in the window, from its audit trail."""
    counts: Counter[str] = Counter()
    for _, event, fields in (r for r in records if start <= r[0] <= end):
        if event == "mitigation_action":
            counts[f"{fields['action']} {fields['step']} {fields['result']}"] += 1
        elif event == "memory_guard_cap" and fields.get("squeezed"):
            counts["squeeze limit writes"] += 1
        elif event == "mitigation_level":
            counts[f"ladder level {fields['ladder_level']}"] += 1
        elif event == "squeeze_judged":
            counts[f"squeeze {fields['verdict']}"] += 1
        elif event in ("drop_cache_finished", "eviction_dry_run", "eviction_chosen",
                       "taint_added", "taint_removed"):
            counts[event] += 1
    return dict(counts)


def timeline(records: Sequence[tuple[float, str, dict[str, Any]]], start: float,
             end: float) -> list[tuple[float, str]]:
    """When in the window the agent acted (seconds from its start), for the record and the
    plot."""
    found = []
    for at, event, fields in records:
        if not start <= at <= end:
            continue
        if event == "mitigation_action" and fields["result"] not in ("unchanged", "skipped"):
            found.append((at - start, f"{fields['action']} {fields['step']}"))
        elif event == "memory_guard_cap" and fields.get("squeezed"):
            squeeze = fields.get("high_bytes") or fields["cap_bytes"]  # v2: memory.high holds
            found.append((at - start, f"squeeze to {squeeze >> 20} MiB"))
        elif event == "mitigation_level":
            found.append((at - start, f"level {fields['ladder_level']}"))
        elif event == "drop_cache_finished":
            found.append((at - start, f"drop cache freed {fields['freed_bytes'] >> 20} MiB"))
    return found



def percentile(values: Sequence[float], q: float) -> float:
    """The q-quantile (0..1) of sorted ``values``, linearly interpolated; infinite values (a
    repetition whose requests went unanswered) stay infinite rather than make a NaN."""
    if not values:
        return math.nan
    position = q * (len(values) - 1)
    low = math.floor(position)
    lower, upper = values[low], values[min(low + 1, len(values) - 1)]
    if position == low or lower == upper:
        return lower
    return lower + (upper - lower) * (position - low)


def mean(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None


def rep_line(rep: Repetition) -> str:
    """A repetition's line as the run prints it."""
    lat = sorted(rep.latencies_ms)
    service = (f"service p99 {fmt(rep_p99(rep), 2)} ms ({rep.service_missed} missed); "
               if rep.service_ms or rep.service_missed else "")
    cpu = "" if rep.agent_cpu_s is None else f", {rep.agent_cpu_s:.1f} CPU s"
    if rep.agent_mib is not None:
        cpu += f", {rep.agent_mib:.0f} MiB at the end"
    if rep.agent_peak_mib is not None:
        cpu += f", peak {rep.agent_peak_mib:.0f} MiB"
    return (f"  online p50 {fmt(percentile(lat, 0.5), 2)} ms p99 "
            f"{fmt(percentile(lat, 0.99), 2)} ms ({len(lat)} iterations); {service}"
            f"offline {rep.offline_mb:.0f} MiB, {rep.work_mib:.0f} MiB checksummed in "
            f"{rep.work_cpu_s:.1f} CPU s; agent: {rep.actions or '-'}{cpu}")


def fmt(value: float | None, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if math.isinf(value):
        return "inf"
    return f"{value:,.{digits}f}"


COLUMNS = ("mode", "rep", "iters", "alone p99", "p50", "p99", "p99.9", "max", "majflt",
           "refaults", "kubepods hits", "PSI mem", "PSI io", "PSI cpu",
           "offline MiB", "MiB/s", "agent actions")


def groups(reps: Sequence[Repetition]) -> Iterator[tuple[str, str, list[Repetition]]]:
    """Per mode, in the order the modes first ran: each repetition alone (labelled by its
    index), then all of them pooled (``all``)."""
    for mode in dict.fromkeys(r.mode for r in reps):
        mine = [r for r in reps if r.mode == mode]
        for r in mine:
            yield mode, str(r.index), [r]
        yield mode, "all", mine


def print_aligned(columns: Sequence[str], rows: Sequence[Sequence[str]], *,
                  text_last: bool = False) -> None:
    """A table: the first column (and the last, ``text_last``) left-aligned, numbers right."""
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(columns)]
    print("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in
                    enumerate(zip(columns, widths, strict=True))))
    last = len(columns) - 1
    for row in rows:
        print("  ".join(v.ljust(w) if i == 0 or (text_last and i == last) else v.rjust(w)
                        for i, (v, w) in enumerate(zip(row, widths, strict=True))))


def table_rows(reps: Sequence[Repetition], duration_s: float) -> list[list[str]]:
    rows = []
    for mode, label, group in groups(reps):
        lat = sorted(v for g in group for v in g.latencies_ms)
        alone = sorted(v for g in group for v in g.alone_ms)
        ind = {k: mean([g.indicators.get(k) for g in group]) for k in group[0].indicators}
        mb = mean([g.offline_mb for g in group]) or 0.0
        actions: Counter[str] = Counter()
        for g in group:
            actions.update(g.actions)
        rows.append([
            mode, label, str(len(lat)),
            fmt(percentile(alone, 0.99), 2), fmt(percentile(lat, 0.5), 2),
            fmt(percentile(lat, 0.99), 2), fmt(percentile(lat, 0.999), 2),
            fmt(lat[-1] if lat else None, 1), fmt(ind.get("majfault"), 0),
            fmt(ind.get("refault"), 0), fmt(ind.get("kubepods_hits"), 0),
            fmt(ind.get("psi_memory_ms_s"), 1), fmt(ind.get("psi_io_ms_s"), 1),
            fmt(ind.get("psi_cpu_ms_s"), 1),
            fmt(mb, 0), fmt(mb / duration_s, 0),
            actions_text(actions, len(group)) if runs_agent(mode) else "-",
        ])
    return rows


def actions_text(actions: Counter[str], reps: int) -> str:
    """The agent's actions, per repetition on average when several are pooled: the ladder's
    rungs, and the pods the eviction manager chose in its own rounds (dry-run by default)."""
    def n(key: str) -> str:
        count = sum(v for k, v in actions.items() if k.startswith(key))
        return f"{count / reps:.1f}".removesuffix(".0")

    return (f"tune {n('tune engage')}+{n('tune release')} rel, squeeze writes "
            f"{n('squeeze limit writes')}, taint {n('taint engage')}, drop_cache "
            f"{n('drop_cache engage')}+{n('drop_cache repeat')}, evict (dry-run) "
            f"{n('evict engage')}+{n('evict repeat')}, eviction choices "
            f"{n('eviction_chosen')}")


def print_table(reps: Sequence[Repetition], settings: Settings) -> None:
    print("latency: online iteration (ms); indicators: online container over the window (mean "
          "per repetition), PSI as ms of 'some' stall per second; kubepods hits: charges that "
          "hit the node-allocatable limit; offline MiB: read + written in the window (mean per "
          "repetition)")
    print_aligned(COLUMNS, table_rows(reps, settings.duration_s), text_last=True)
    for r in reps:
        for line in (*r.problems, *r.stalls):
            print(f"{r.mode} rep {r.index}: {line}")
    for line in applied_lines(reps):
        print(line)


def applied_lines(reps: Sequence[Repetition]) -> list[str]:
    """What each mode wrote on the containers at creation beside kubelet's defaults: an agent
    mode's CreateContainer answers, kubelet's MemoryQoS values."""
    lines = []
    for mode in dict.fromkeys(r.mode for r in reps):
        applied = sorted({a for r in reps if r.mode == mode for a in r.adjustments})
        if applied:
            source = "its CreateContainer answers" if runs_agent(mode) else "kubelet's values"
            lines.append(f"{mode} applied at creation ({source}): {'; '.join(applied)}")
    return lines


SERVICE_COLUMNS = ("mode", "rep", "requests", "p50", "p99", "p99.9", "missed", "CPU ms/req",
                   "wait ms/req", "offline MiB", "work MiB", "work CPU s", "MiB/CPU s",
                   "agent CPU s")


def served(reps: Sequence[Repetition]) -> bool:
    return any(r.service_ms or r.service_missed for r in reps)


def per_request_ms(rep: Repetition, key: str) -> float | None:
    """A service's time counter over the window (ns) per request it was sent, in ms."""
    total = rep.indicators.get(key)
    requests = len(rep.service_ms) + rep.service_missed
    return None if total is None or not requests else total / requests / 1e6


def service_rows(reps: Sequence[Repetition]) -> list[list[str]]:
    rows = []
    for mode, label, group in groups(reps):
        answered = [v for g in group for v in g.service_ms]
        missed = sum(g.service_missed for g in group)
        work = mean([g.work_mib for g in group]) or 0.0
        cpu = mean([g.work_cpu_s for g in group]) or 0.0
        rows.append([
            mode, label, str(len(answered) + missed),
            *(fmt(tail_percentile(answered, missed, q), 2) for q in (0.5, 0.99, 0.999)),
            str(missed),
            *(fmt(mean([per_request_ms(g, key) for g in group]), 3)
              for key in ("service_run_ns", "service_wait_ns")),
            fmt(mean([g.offline_mb for g in group]) or 0.0, 0), fmt(work, 0),
            fmt(cpu, 1), fmt(work / cpu if cpu else None, 0),
            fmt(mean([g.agent_cpu_s for g in group if g.agent_cpu_s is not None]), 1)])
    return rows


def print_service_table(reps: Sequence[Repetition], settings: Settings) -> None:
    service = (f"online key-value service at {settings.online_rps:g} requests/s, open loop "
               f"(ms from each request's due time; missed: no answer within "
               f"{settings.service_timeout_ms:g} ms, infinitely late in the percentiles)"
               if served(reps) else "no online service in this run")
    print(f"{service}; CPU and wait ms/req: the service's time on a CPU and runnable waiting "
          f"for one, per request; offline work: MiB checksummed (SHA-256 x "
          f"{settings.offline_work_rounds}) and the CPU seconds it took, mean per repetition")
    print_aligned(SERVICE_COLUMNS, service_rows(reps))


COST_COLUMNS = ("mode", "rep", "tier max hits", "tier high hits", "tier refault MiB",
                "tier majflt", "tier PSI mem", "tier PSI io", "kswapd scan MiB", "agent MiB",
                "agent peak MiB", "bench CPU s")
PAGE_MIB = 4096 / (1 << 20)


def cost_rows(reps: Sequence[Repetition]) -> list[list[str]]:
    """What the offline tier and the machine paid per repetition, and the mean per mode."""
    rows = []
    for mode, label, group in groups(reps):

        def avg(key: str, scale: float = 1.0, group: list[Repetition] = group) -> float | None:
            found = mean([g.indicators.get(key) for g in group])
            return None if found is None else found * scale

        rows.append([
            mode, label, fmt(avg("offline_tier_hits"), 0),
            fmt(avg("offline_tier_throttled"), 0),
            fmt(avg("offline_refault", PAGE_MIB), 0), fmt(avg("offline_majfault"), 0),
            fmt(avg("offline_psi_memory_ms_s"), 1), fmt(avg("offline_psi_io_ms_s"), 1),
            fmt(avg("kswapd_scan", PAGE_MIB), 0),
            fmt(mean([g.agent_mib for g in group]), 0),
            fmt(mean([g.agent_peak_mib for g in group]), 0),
            fmt(mean([g.bench_cpu_s for g in group]), 1)])
    return rows


def print_cost_table(reps: Sequence[Repetition]) -> None:
    print("offline cost: the offline tier (kubepods/besteffort) over the window: charges that "
          "hit its limit, times it went over memory.high (v2), file pages read again after "
          "reclaim, major faults, PSI 'some' ms/s; "
          "the machine's kswapd scanning; the agent pod's peak memory; the benchmark process's CPU "
          "(the runtime simulator and API server stand-in the agents talk to) (mean per "
          "repetition)")
    print_aligned(COST_COLUMNS, cost_rows(reps))


def rep_p99(rep: Repetition) -> float:
    """A repetition's online p99: the service's when it ran, else the probe's."""
    if rep.service_ms or rep.service_missed:
        return tail_percentile(rep.service_ms, rep.service_missed, 0.99)
    return percentile(sorted(rep.latencies_ms), 0.99)


def mode_p99(reps: Sequence[Repetition], mode: str) -> float:
    """A mode's pooled online p99: the service's when it ran, else the probe's."""
    mine = [r for r in reps if r.mode == mode]
    if served(mine):
        return tail_percentile([v for r in mine for v in r.service_ms],
                               sum(r.service_missed for r in mine), 0.99)
    return percentile(sorted(v for r in mine for v in r.latencies_ms), 0.99)


def intervals(reps: Sequence[Repetition], seed: int) -> dict[str, dict[str, tuple[float, float]]]:
    """Per mode, the bootstrap 95 % intervals of the median per-repetition p99 and of the mean
    offline MiB, over its repetitions."""
    found = {}
    for mode in dict.fromkeys(r.mode for r in reps):
        mine = [r for r in reps if r.mode == mode]
        found[mode] = {
            "p99": bootstrap_interval([rep_p99(r) for r in mine],
                                      lambda v: percentile(sorted(v), 0.5), seed),
            "offline": bootstrap_interval([r.offline_mb for r in mine],
                                          lambda v: sum(v) / len(v), seed)}
    return found


def print_intervals(reps: Sequence[Repetition], seed: int) -> None:
    for mode, found in intervals(reps, seed).items():
        (p_lo, p_hi), (o_lo, o_hi) = found["p99"], found["offline"]
        print(f"{mode}: per-repetition p99 95 % interval {fmt(p_lo, 2)}-{fmt(p_hi, 2)} ms; "
              f"offline {fmt(o_lo, 0)}-{fmt(o_hi, 0)} MiB")


def final_line(reps: Sequence[Repetition]) -> str:
    """``online p99 ms: unmanaged=… static=… …; offline MiB: unmanaged=… …`` over the modes
    that ran, in the order of MODES and variants after them (pooled p99: the online service's
    when it ran, else the probe's; mean offline MiB per repetition)."""
    ran = in_order(r.mode for r in reps)

    def mib(mode: str) -> float:
        return mean([r.offline_mb for r in reps if r.mode == mode]) or 0.0

    return ("online p99 ms: " + " ".join(f"{m}={fmt(mode_p99(reps, m), 2)}" for m in ran)
            + "; offline MiB: " + " ".join(f"{m}={mib(m):.0f}" for m in ran))


def summary(reps: Sequence[Repetition]) -> dict[str, dict[str, Any]]:
    """Per mode, pooled: the probe's and the service's p50/p99/p99.9 (ms), the service's
    requests and misses, the offline MiB, work MiB and work CPU seconds, the agent's CPU seconds,
    MiB at the window's end and peak MiB (mean per repetition)."""
    found: dict[str, dict[str, Any]] = {}
    for mode in dict.fromkeys(r.mode for r in reps):
        mine = [r for r in reps if r.mode == mode]
        probe = sorted(v for r in mine for v in r.latencies_ms)
        answered = [v for r in mine for v in r.service_ms]
        missed = sum(r.service_missed for r in mine)
        found[mode] = {
            "probe_ms": {f"p{100 * q:g}": percentile(probe, q) for q in (0.5, 0.99, 0.999)},
            "service_ms": {f"p{100 * q:g}": tail_percentile(answered, missed, q)
                           for q in (0.5, 0.99, 0.999)},
            "service_requests": len(answered) + missed, "service_missed": missed,
            "offline_mib": mean([r.offline_mb for r in mine]),
            "work_mib": mean([r.work_mib for r in mine]),
            "work_cpu_s": mean([r.work_cpu_s for r in mine]),
            "agent_cpu_s": mean([r.agent_cpu_s for r in mine if r.agent_cpu_s is not None]),
            "agent_mib": mean([r.agent_mib for r in mine]),
            "agent_peak_mib": mean([r.agent_peak_mib for r in mine])}
    return found


def as_json(reps: Sequence[Repetition], settings: Settings, machine: dict[str, str]) -> str:
    return json.dumps({"settings": dataclasses.asdict(settings), "machine": machine,
                       "summary": summary(reps),
                       "repetitions": [dataclasses.asdict(r) for r in reps]})


def from_json(text: str) -> tuple[list[Repetition], Settings, dict[str, str]]:
    raw = json.loads(text)
    settings = Settings(**{**raw["settings"], "modes": tuple(raw["settings"]["modes"])})
    reps = [Repetition(**{**r, "progress": [tuple(p) for p in r["progress"]],
                          "events": [tuple(e) for e in r["events"]]})
            for r in raw["repetitions"]]
    return reps, settings, raw["machine"]

