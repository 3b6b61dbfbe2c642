"""Refusals on the wire: counted for the agent's life, logged once per kind and connection."""

from __future__ import annotations

import io
import json

from nri_plugin.obs.logs import LoggingConfig, LoggingSetup
from nri_plugin.wire.rejections import ConnectionRejections, Rejection, RejectionCounts


def test_first_of_a_kind_is_logged_the_rest_counted_and_totals_span_connections() -> None:
    stream = io.StringIO()
    setup = LoggingSetup(LoggingConfig(format="json"), level="info", stream=stream)
    try:
        totals = RejectionCounts()
        for _ in range(2):  # two connections, one after the other
            connection = ConnectionRejections(totals)
            connection(Rejection.BAD_STREAM_ID, "x" * 10_000, stream_id=4)
            connection(Rejection.BAD_STREAM_ID, "again")
            connection(Rejection.UNKNOWN_CONNECTION, "skipped", count=5)
            connection.summarize()
        ConnectionRejections(totals).summarize()  # nothing refused: nothing said
    finally:
        setup.close()
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    warnings = [line for line in lines if line["event"] == "nri_rejected"]
    assert [(w["kind"], w["level"]) for w in warnings] == [
        ("bad_stream_id", "warning"), ("unknown_connection", "warning")] * 2
    assert warnings[0]["stream_id"] == 4
    assert len(warnings[0]["detail"]) < 400  # the refused input is quoted bounded
    summaries = [line["counts"] for line in lines if line["event"] == "nri_rejections"]
    assert summaries == [{"bad_stream_id": 2, "unknown_connection": 5}] * 2
    assert totals[Rejection.BAD_STREAM_ID] == 4
    assert totals.total == 14
    assert totals.as_dict()["stalled"] == 0
