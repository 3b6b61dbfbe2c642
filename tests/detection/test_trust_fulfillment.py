"""The reclaimed tier's fulfillment weighs the memory guard's cap against the requests of the
pods that cap bounds: a pod outside the BestEffort tier that claims ``reclaimed_cores`` (any pod
may claim a lower level) is not bounded by it, and its request must not make the tier look
starved, which would have the reclaimed tier's plugin evict the tier's pods."""

from __future__ import annotations

from pathlib import Path

import pytest

from reconciler.detection.detectors import RECLAIMED_TIER
from reconciler.detection.signals import Level
from tests.support.detection_env import Setup
from tests.support.fakesys import GIB, MIB


@pytest.mark.parametrize("version", [1, 2])
def test_a_pod_outside_the_tier_claiming_reclaimed_does_not_starve_the_tier(
        tmp_path: Path, version: int) -> None:
    s = Setup(tmp_path, version, entry_samples=1)
    s.pod("a", "reclaimed_cores", request=GIB, anon=MIB)
    # A burstable pod that claims the lowest level, with a request ten times the tier's cap.
    s.pod("claimer", "reclaimed_cores", request=10 * GIB, anon=MIB, tier="burstable")
    limit = "memory.limit_in_bytes" if version == 1 else "memory.max"
    (s.host.tier_dir("besteffort") / limit).write_text(f"{GIB}\n")
    s.loop().cycle(0.0)
    reading = s.reading("fulfillment", RECLAIMED_TIER)
    assert reading is not None
    assert (reading.value, reading.level) == (1.0, Level.NONE)


def test_only_pods_outside_the_tier_give_no_reading(tmp_path: Path) -> None:
    s = Setup(tmp_path, entry_samples=1)
    s.pod("claimer", "reclaimed_cores", request=10 * GIB, anon=MIB, tier="guaranteed")
    (s.host.tier_dir("besteffort") / "memory.limit_in_bytes").write_text(f"{GIB}\n")
    s.loop().cycle(0.0)
    assert s.reading("fulfillment", RECLAIMED_TIER) is None
