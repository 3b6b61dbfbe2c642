"""What ``kubernetes.watch.Watch`` does with what a watch stream may carry, beside the pod
watch's own reader: the evidence for keeping ours (``reconciler/kube/watch.py`` says why)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException
from kubernetes.watch import Watch

from reconciler.kube.watch import LineReader
from tests.support.fake_apiserver import make_pod


class StreamedResponse:
    """A response as the client returns it with ``_preload_content=False``: chunks as sent."""

    status = 200

    def __init__(self, *chunks: bytes) -> None:
        self._chunks = chunks

    def stream(self, amt: int | None = None, decode_content: bool = True) -> Iterator[bytes]:
        return iter(self._chunks)

    def close(self) -> None:
        pass

    def release_conn(self) -> None:
        pass


def line(kind: str, obj: dict[str, Any]) -> bytes:
    return json.dumps({"type": kind, "object": obj}).encode() + b"\n"


def library_events(*chunks: bytes) -> list[Any]:
    """Everything the library's watch yields for a stream of ``chunks``, with a server-side
    timeout as the pod watch sets one."""

    def list_pods(**_: Any) -> StreamedResponse:
        return StreamedResponse(*chunks)

    return list(Watch(return_type="V1Pod").stream(list_pods, timeout_seconds=60))


def test_library_watch_drops_an_unterminated_last_line() -> None:
    first, second = line("ADDED", make_pod("a")), line("MODIFIED", make_pod("a"))
    assert len(library_events(first + second[:25])) == 1
    ours = LineReader(StreamedResponse(first + second[:25]))
    assert ours.read_lines() == [first.rstrip(b"\n")]
    with pytest.raises(ValueError, match="inside an event"):
        ours.read_lines()


def test_library_watch_yields_none_for_a_line_that_is_not_json() -> None:
    assert library_events(b"not json\n") == [None]


def test_library_watch_raises_key_error_for_an_error_event_without_code() -> None:
    with pytest.raises(KeyError):
        library_events(line("ERROR", {"message": "broken"}))


def test_library_watch_raises_on_gone_as_ours_relists() -> None:
    with pytest.raises(ApiException) as raised:
        library_events(line("ERROR", {"code": 410, "reason": "Expired", "message": "too old"}))
    assert raised.value.status == 410
