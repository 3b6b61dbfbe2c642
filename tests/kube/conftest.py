"""The kubernetes client the agent builds, for the ``cfg`` fixture each module sets its timeouts
in."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from reconciler.kube import KubernetesConfig
from tests.support.fake_apiserver import api_client


@pytest.fixture
def api(cfg: KubernetesConfig) -> Iterator[Any]:
    with api_client(cfg) as client:
        yield client
