"""A broken or hostile runtime against a real ``nri-qos run`` process (prints numbers; not a test).

The agent runs as a child process (``python -m nri_plugin run``), connected to a unix socket this
process listens on, as containerd's would be. This process plays a runtime that misbehaves, one
case after the other: garbage, oversized frames, stalls in the middle of the handshake or of a
frame, floods of requests whose answers it never reads, messages of many megabytes, strings of
megabytes where names belong, and every kind of request the wire protocol refuses.

After each case the agent must still work: on the same connection when the case leaves it usable,
otherwise after it reconnected, a whole handshake and a CreateContainer must be answered. The one
line printed says:

* ``cases``: cases played;
* ``alive``: cases after which the agent served the next handshake and CreateContainer;
* ``hangs``: bounded waits that ran out (the agent neither answered nor closed in time);
* ``wrong``: cases where the agent answered what it must not (e.g. served CreateContainer before
  Configure) or dropped a connection it must keep;
* ``max RSS growth``: the largest rise of the agent's resident memory during one case, from just
  before the case to its peak (sampled, and the kernel's high-water mark reset per case);
* ``longest log line``: in bytes, over everything the agent logged.

Targets: no hang, at most 100 MB of RSS growth in the worst case, no log line over 4 KiB.

usage: python bench/hostile_runtime.py [--verbose] [--only NAME ...] [--agent DIR]

``--agent`` runs the agent from another source tree (e.g. an older revision, for comparison).

The runtime states a registration timeout of ``--registration-timeout-ms`` (default 2000, the
agent's ``register_timeout_ms`` is set to the same) so that stall cases end in seconds; with
containerd's default of 5 s they take proportionally longer.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import struct
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.hostile_outcomes import Outcome, Result  # noqa: E402
from bench.hostile_refusals import (  # noqa: E402
    Hang,
    Send,
    bad_envelope,
    even_stream,
    reused_stream,
    stray_response,
    unknown_connection,
    unknown_frame_type,
    unknown_method,
    unknown_service,
)
from bench.rss_watch import RssWatch  # noqa: E402
from nri_plugin.wire.envelope import encode_request  # noqa: E402
from nri_plugin.wire.mux import (  # noqa: E402
    MAX_MUX_PAYLOAD,
    PLUGIN_SERVICE_CONN,
    encode_message,
)
from nri_plugin.wire.nri_api import PLUGIN_SERVICE  # noqa: E402
from nri_plugin.wire.status import StatusCode  # noqa: E402
from nri_plugin.wire.ttrpc import MAX_DATA_LENGTH, MessageType, encode_frame  # noqa: E402
from protos import nri_api_pb2 as api  # noqa: E402
from tests.support.raw_runtime import (  # noqa: E402
    ANSWER_S,
    Agent,
    MiB,
    RawRuntime,
    configure_request,
    container_message,
    mux_frame,
    pod_message,
    running_agent,
    status_kib,
)

CONFIG = """
[plugin]
register_timeout_ms = {timeout_ms}
reconnect_initial_ms = 200
reconnect_max_ms = 1000
[reconciler]
enabled = false
[resctrl]
enabled = false
"""
LOG_LINE_TARGET = 4096
RSS_TARGET_MB = 100.0


# -- the cases ----------------------------------------------------------------------------------


@dataclass
class Bench:
    agent: Agent
    timeout_ms: int

    @property
    def stall_s(self) -> float:
        """How long the agent may take to drop a runtime that stalls: its deadline plus slack."""
        return self.timeout_ms / 1000 + 2.0

    async def accept(self) -> RawRuntime:
        return await self.agent.accept(15)

    async def expect_closed(self, conn: RawRuntime, what: str) -> Outcome:
        if await conn.closed_within(self.stall_s):
            return Outcome(kept=False, note=f"closed: {what}")
        raise Hang(f"still connected {self.stall_s:g} s after {what}")

    # Huge messages ------------------------------------------------------------------------------

    async def sync_split(self, conn: RawRuntime, chunks: int, per_chunk_pods: int,
                         blob_bytes: int) -> Outcome:
        await conn.register()
        await conn.call("Configure", configure_request(self.timeout_ms))
        blob = "b" * blob_bytes
        slowest = 0.0
        for i in range(chunks):
            pods = [pod_message(f"s{i}-{j}", annotations={"bench/blob": blob})
                    for j in range(per_chunk_pods)]
            request = api.SynchronizeRequest(pods=pods, more=i < chunks - 1)
            started = time.perf_counter()
            reply = await conn.call("Synchronize", request.SerializeToString())
            slowest = max(slowest, time.perf_counter() - started)
            if not reply.ok:
                raise ValueError(f"chunk {i} refused: {reply.message}")
        wire = chunks * per_chunk_pods * blob_bytes / MiB
        return Outcome(kept=True, note=f"{chunks} chunks, {wire:.0f} MiB; slowest chunk answered "
                                       f"in {slowest * 1000:.0f} ms")

    async def big_pods(self, conn: RawRuntime, key: str) -> Outcome:
        await conn.handshake(self.timeout_ms)
        blob = "a" * (3 * MiB)
        for i in range(20):
            pod = pod_message(f"big{i}", annotations={key: blob})
            await conn.call("RunPodSandbox", api.RunPodSandboxRequest(pod=pod).SerializeToString())
            await conn.call("CreateContainer", api.CreateContainerRequest(
                pod=pod, container=container_message(f"big{i}")).SerializeToString())
        for i in range(20):
            pod = pod_message(f"big{i}", annotations={key: blob})
            await conn.call("RemovePodSandbox",
                            api.RemovePodSandboxRequest(pod=pod).SerializeToString())
        return Outcome(kept=True, note=f"20 pods with 3 MiB under {key}, created and removed")

    async def pods_at_their_limit(self, conn: RawRuntime) -> Outcome:
        await conn.handshake(self.timeout_ms)
        annotations = {"qos.nri-qos.io/level": "shared_cores",
                       "volcano.sh/colocation-config": "{" + " " * 16000 + "}"}
        count = 1000
        for i in range(count):
            pod = pod_message(f"full{i}", annotations=annotations)
            await conn.call("RunPodSandbox", api.RunPodSandboxRequest(pod=pod).SerializeToString())
        for i in range(count):
            pod = pod_message(f"full{i}", annotations=annotations)
            await conn.call("RemovePodSandbox",
                            api.RemovePodSandboxRequest(pod=pod).SerializeToString())
        return Outcome(kept=True, note=f"{count} pods keeping 16 KiB each, created and removed")

    async def huge_create_container(self, conn: RawRuntime) -> Outcome:
        await conn.handshake(self.timeout_ms)
        container = container_message("huge")
        container.env.extend(["X=" + "e" * 1000] * 4000)
        request = api.CreateContainerRequest(pod=pod_message("huge"), container=container)
        reply = await conn.call("CreateContainer", request.SerializeToString())
        return Outcome(kept=True, note=f"{request.ByteSize() / MiB:.1f} MiB CreateContainer: "
                                       f"{'ok' if reply.ok else reply.message}")

    # Stalls ------------------------------------------------------------------------------------

    async def never_answer_register(self, conn: RawRuntime) -> Outcome:
        await conn.frame()
        return await self.expect_closed(conn, "RegisterPlugin never answered")

    async def no_configure(self, conn: RawRuntime) -> Outcome:
        await conn.register()
        return await self.expect_closed(conn, "no Configure")

    async def half_configure(self, conn: RawRuntime) -> Outcome:
        await conn.register()
        whole = conn.request_bytes("Configure", configure_request(self.timeout_ms), conn.stream())
        conn.write(whole[: len(whole) // 2])
        return await self.expect_closed(conn, "half a Configure")

    async def bare_mux_header(self, conn: RawRuntime) -> Outcome:
        await conn.register()
        conn.write(struct.pack(">II", PLUGIN_SERVICE_CONN, MAX_MUX_PAYLOAD))
        return await self.expect_closed(conn, "a bare mux header announcing 16 MiB")

    async def oversized_header_only(self, conn: RawRuntime) -> Outcome:
        await conn.handshake(self.timeout_ms)
        header = struct.pack(">IIBB", 0xFFFFFFFF, conn.stream(), MessageType.REQUEST, 0)
        conn.write(mux_frame(PLUGIN_SERVICE_CONN, header))
        return await self.expect_closed(conn, "a ttrpc header announcing 4 GiB, no data")

    async def no_synchronize(self, conn: RawRuntime) -> Outcome:
        await conn.register()
        await conn.call("Configure", configure_request(self.timeout_ms))
        return await self.expect_closed(conn, "no Synchronize")

    async def sync_chunk_then_nothing(self, conn: RawRuntime) -> Outcome:
        await conn.register()
        await conn.call("Configure", configure_request(self.timeout_ms))
        request = api.SynchronizeRequest(pods=[pod_message("first")], more=True)
        await conn.call("Synchronize", request.SerializeToString())
        return await self.expect_closed(conn, "one Synchronize chunk, then nothing")

    # Floods ------------------------------------------------------------------------------------

    async def unread_answers(self, conn: RawRuntime) -> Outcome:
        await conn.handshake(self.timeout_ms)
        envelope = encode_request(PLUGIN_SERVICE, "NoSuchMethod", b"")
        sent = 0
        blocked = False
        while sent < 1_000_000 and not blocked:
            batch = b"".join(
                encode_message(PLUGIN_SERVICE_CONN, encode_frame(
                    conn.stream(), MessageType.REQUEST, envelope))
                for _ in range(2000))
            conn.write(batch)
            sent += 2000
            try:
                await conn.flush(1.0)
            except TimeoutError:
                blocked = True
        # Not reading: the agent has to cope with answers nobody takes.
        await asyncio.sleep(self.stall_s)
        closed = await conn.closed_within(ANSWER_S)
        if not closed:
            return Outcome(kept=True, note=f"{sent} requests, answers unread; kept")
        return Outcome(kept=False, note=f"{sent} requests sent"
                                        f"{' until the agent stopped reading' if blocked else ''}"
                                        "; answers left unread; closed")

    async def request_flood(self, conn: RawRuntime, method: str, count: int) -> Outcome:
        await conn.handshake(self.timeout_ms)
        payload = b"\xff\xff garbage"
        last = 0
        for start in range(0, count, 1000):
            ids = [conn.stream() for _ in range(min(1000, count - start))]
            conn.write(b"".join(conn.request_bytes(method, payload, i) for i in ids))
            last = ids[-1]
            await conn.flush()
        reply = await conn.answer(last, seconds=30)
        return Outcome(kept=True, note=f"{count} x {method}: last answered "
                                       f"{StatusCode(reply.code).name}")

    async def unknown_connection_flood(self, conn: RawRuntime) -> Outcome:
        await conn.handshake(self.timeout_ms)
        frame = struct.pack(">II", 7, 32) + bytes(32)
        for _ in range(100):
            conn.write(frame * 1000)
            await conn.flush()
        return Outcome(kept=True, note="100000 mux frames for connection 7")

    # Strings -----------------------------------------------------------------------------------

    async def huge_runtime_name(self, conn: RawRuntime) -> Outcome:
        await conn.register()
        reply = await conn.call("Configure", configure_request(
            self.timeout_ms, runtime_name="r" * (MAX_DATA_LENGTH - 4096)))
        if not reply.ok:
            raise ValueError(f"Configure refused: {reply.message}")
        await conn.call("Synchronize", b"")
        return Outcome(kept=True, note="4 MiB runtime name")

    async def huge_pod_name(self, conn: RawRuntime) -> Outcome:
        await conn.handshake(self.timeout_ms)
        pod = pod_message("longname", name="n" * (MAX_DATA_LENGTH - 8192))
        for _ in range(5):
            await conn.call("RunPodSandbox", api.RunPodSandboxRequest(pod=pod).SerializeToString())
            await conn.call("CreateContainer", api.CreateContainerRequest(
                pod=pod, container=container_message("longname")).SerializeToString())
        return Outcome(kept=True, note="4 MiB pod name, 10 events")

    async def huge_register_error(self, conn: RawRuntime) -> Outcome:
        await conn.register(error="e" * 100_000)
        return await self.expect_closed(conn, "RegisterPlugin refused with a 100 KB error")

    # Refusals ----------------------------------------------------------------------------------

    async def refused(self, conn: RawRuntime, send: Send) -> Outcome:
        await conn.handshake(self.timeout_ms)
        return Outcome(kept=True, note=await send(conn))

    async def garbage_configure_then_create(self, conn: RawRuntime) -> Outcome:
        await conn.register()
        configure = conn.send("Configure", b"\xff\xff\xff\xff")
        create = conn.send("CreateContainer", api.CreateContainerRequest(
            pod=pod_message("x"), container=container_message("x")).SerializeToString())
        reply = await conn.answer(configure)
        served = "no answer"
        try:
            answer = await conn.answer(create, seconds=1.0)
            served = StatusCode(answer.code).name
            if answer.ok:
                raise ValueError("CreateContainer served after a failed Configure")
        except (EOFError, TimeoutError, OSError):
            # The agent hung up on the request it did not serve (unread: the socket resets).
            return Outcome(kept=False, note=f"closed after Configure answered "
                                            f"{StatusCode(reply.code).name}; CreateContainer "
                                            "not served")
        outcome = await self.expect_closed(conn, "a Configure that does not decode")
        outcome.note += f" (Configure {StatusCode(reply.code).name}, CreateContainer {served})"
        return outcome

    async def oversized_frame(self, conn: RawRuntime) -> Outcome:
        await conn.handshake(self.timeout_ms)
        stream_id = conn.stream()
        header = struct.pack(">IIBB", MAX_DATA_LENGTH + 1, stream_id, MessageType.REQUEST, 0)
        data = header + bytes(MAX_DATA_LENGTH + 1)
        conn.write(mux_frame(PLUGIN_SERVICE_CONN, data[:4096]))
        conn.write(mux_frame(PLUGIN_SERVICE_CONN, data[4096:]))
        reply = await conn.answer(stream_id)
        return Outcome(kept=True, note=f"4 MiB + 1 frame answered {StatusCode(reply.code).name}")

    async def mux_garbage(self, conn: RawRuntime) -> Outcome:
        await conn.register()
        rng = random.Random(16)
        conn.write(b"\x00\x00\x00\x01\xff\xff\xff\xff" + rng.randbytes(64 << 10))
        return await self.expect_closed(conn, "garbage (a mux header announcing 4 GiB)")

    async def truncated_then_eof(self, conn: RawRuntime) -> Outcome:
        await conn.handshake(self.timeout_ms)
        whole = conn.request_bytes("CreateContainer", b"x" * 1000, conn.stream())
        conn.write(whole[:500])
        await conn.flush()
        conn.close()
        return Outcome(kept=False, note="half a frame, then the runtime hung up")


# -- running it all -----------------------------------------------------------------------------


Case = Callable[[RawRuntime], Awaitable[Outcome]]


def cases(bench: Bench) -> list[tuple[str, Case]]:
    b = bench
    refusals: list[tuple[str, Send]] = [
        ("even_stream_id", even_stream), ("reused_stream_id", reused_stream),
        ("unknown_service", unknown_service), ("unknown_method", unknown_method),
        ("bad_envelope", bad_envelope), ("unknown_frame_type", unknown_frame_type),
        ("unknown_mux_connection", unknown_connection), ("stray_response", stray_response),
    ]

    async def before_configure(conn: RawRuntime) -> Outcome:
        await conn.register()
        reply = await conn.call("CreateContainer", api.CreateContainerRequest(
            pod=pod_message("early"), container=container_message("early")).SerializeToString())
        if reply.ok:
            raise ValueError("CreateContainer served before Configure")
        await conn.call("Configure", configure_request(b.timeout_ms))
        await conn.call("Synchronize", b"")
        return Outcome(kept=True, note=f"CreateContainer before Configure: "
                                       f"{StatusCode(reply.code).name}")

    def refusal(send: Send) -> Case:
        return lambda conn: b.refused(conn, send)

    return [
        ("sync_split_97MiB", lambda c: b.sync_split(c, 40, 50, 48 << 10)),
        ("sync_split_within_limits", lambda c: b.sync_split(c, 20, 50, 48 << 10)),
        ("pods_3MiB_unread_annotation", lambda c: b.big_pods(c, "bench/blob")),
        ("pods_3MiB_read_annotation", lambda c: b.big_pods(c, "qos.nri-qos.io/level")),
        ("pods_at_their_limit", b.pods_at_their_limit),
        ("huge_create_container", b.huge_create_container),
        ("never_answer_register", b.never_answer_register),
        ("no_configure", b.no_configure),
        ("half_configure", b.half_configure),
        ("bare_mux_header_16MiB", b.bare_mux_header),
        ("ttrpc_header_4GiB_no_data", b.oversized_header_only),
        ("no_synchronize", b.no_synchronize),
        ("sync_chunk_then_nothing", b.sync_chunk_then_nothing),
        ("unread_answers", b.unread_answers),
        ("garbage_payload_flood", lambda c: b.request_flood(c, "CreateContainer", 100_000)),
        ("unknown_method_flood", lambda c: b.request_flood(c, "NoSuchMethod", 100_000)),
        ("unknown_connection_flood", b.unknown_connection_flood),
        ("huge_runtime_name", b.huge_runtime_name),
        ("huge_pod_name", b.huge_pod_name),
        ("huge_register_error", b.huge_register_error),
        *((name, refusal(send)) for name, send in refusals),
        ("event_before_configure", before_configure),
        ("garbage_configure_then_create", b.garbage_configure_then_create),
        ("oversized_frame", b.oversized_frame),
        ("mux_garbage", b.mux_garbage),
        ("truncated_frame_then_eof", b.truncated_then_eof),
    ]


async def still_alive(bench: Bench, conn: RawRuntime, outcome: Outcome | None) -> bool:
    """The agent answers a CreateContainer: on the case's connection when it is kept, else on
    the next one, after a whole handshake. A connection the agent made while the case still
    ran may have given up on its RegisterPlugin already (this runtime was busy): then the one
    after it."""
    if outcome is not None and outcome.kept:
        try:
            if await conn.create_container_ok():
                conn.close()
                return True
        except (EOFError, TimeoutError, OSError):
            pass
    conn.close()
    for _ in range(3):
        fresh = await bench.accept()
        try:
            await fresh.handshake(bench.timeout_ms)
            return await fresh.create_container_ok()
        except (EOFError, OSError):
            continue
        finally:
            fresh.close()
    return False


async def play(bench: Bench, pid: int, only: set[str],
               verbose: bool) -> list[Result]:
    results = []
    watch = RssWatch(pid)
    first = await bench.accept()
    await first.handshake(bench.timeout_ms)
    first.close()
    for name, case in cases(bench):
        if only and name not in only:
            continue
        result = Result(name)
        conn = await bench.accept()
        before = watch.start()
        outcome: Outcome | None = None
        try:
            outcome = await case(conn)
            result.note = outcome.note
        except Hang as exc:
            result.hang, result.error = True, str(exc)
        except (TimeoutError, EOFError, OSError, ValueError) as exc:
            result.error = f"{type(exc).__name__}: {exc}"
            result.hang = isinstance(exc, TimeoutError)
        try:
            result.alive = await still_alive(bench, conn, outcome)
        except (TimeoutError, EOFError, OSError, ValueError) as exc:
            result.error += f"; not alive after: {type(exc).__name__}: {exc}"
            result.hang = result.hang or isinstance(exc, TimeoutError)
        peak = watch.stop()
        result.growth_mb = (peak - before) / 1024
        result.retained_mb = (status_kib(pid, "VmRSS") - before) / 1024
        results.append(result)
        if verbose:
            print(f"  {name:<30} alive={result.alive!s:<5} hang={result.hang!s:<5} "
                  f"rss +{result.growth_mb:6.1f} MB (kept {result.retained_mb:+6.1f})  "
                  f"{result.note}{'  ERROR ' + result.error if result.error else ''}",
                  flush=True)
    return results


async def run(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="nri-hostile-") as tmp:
        config = CONFIG.format(timeout_ms=args.registration_timeout_ms)
        started = time.perf_counter()
        async with running_agent(Path(tmp), config, source=args.agent) as agent:
            bench = Bench(agent, args.registration_timeout_ms)
            results = await play(bench, agent.pid, set(args.only or ()), args.verbose)
        lines = agent.log_path.read_bytes().splitlines()
    longest = max(lines, key=len, default=b"")
    worst = max(results, key=lambda r: r.growth_mb)
    if args.verbose:
        print(f"  {len(lines)} log lines; the longest: {longest[:300]!r}")
    wrong = [r.name for r in results if r.error and not r.hang]
    if args.verbose and wrong:
        print(f"  cases the agent got wrong: {', '.join(wrong)}")
    print(f"cases {len(results)}  alive {sum(r.alive for r in results)}  "
          f"hangs {sum(r.hang for r in results)}  wrong {len(wrong)}  "
          f"max RSS growth {worst.growth_mb:.1f} MB ({worst.name})  "
          f"longest log line {len(longest)} B  "
          f"[targets: no hang, <= {RSS_TARGET_MB:.0f} MB, <= {LOG_LINE_TARGET} B; "
          f"{time.perf_counter() - started:.0f} s]")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--verbose", "-v", action="store_true", help="a line per case")
    parser.add_argument("--only", nargs="*", metavar="NAME", help="play only these cases")
    parser.add_argument("--registration-timeout-ms", type=int, default=2000)
    parser.add_argument("--agent", type=Path, default=REPO, metavar="DIR",
                        help="source tree of the agent to run (default: this one)")
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
