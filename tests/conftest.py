"""Guards every test runs under: no task may outlive its test; a failure is always reported.

Also the real-kernel tier's hooks (:mod:`tests.vm.tier`): ``vm`` tests go to guests; and the
fixtures tests of several folders share.
"""

from __future__ import annotations

import asyncio
import gc
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Generator, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.support.eviction_env import NODE
from tests.support.fake_apiserver import FakeApiServer
from tests.vm import tier


def pytest_configure(config: pytest.Config) -> None:
    tier.configure(config)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    tier.generate(metafunc)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # trylast: after the -m selection, so only the selected tests boot guests.
    tier.replace_items(config, items)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    tier.record(report)


@pytest.fixture(autouse=True)
def kernel_under_test(request: pytest.FixtureRequest) -> str:
    """``host`` or ``v1-guest`` for a ``real_kernel`` test (see :mod:`tests.vm.tier`)."""
    return tier.kernel_under_test(request)


@pytest.fixture(autouse=True)
def scheduling_restored() -> Iterator[None]:
    """An agent served in the test's process puts the thread under its CPU scheduling policy
    (:mod:`nri_plugin.scheduling`); the next test runs under the policy the run began with."""
    policy = os.sched_getscheduler(0)
    yield
    if os.sched_getscheduler(0) != policy:
        os.sched_setscheduler(0, policy, os.sched_param(0))


@pytest.fixture(autouse=True)
async def no_task_left_behind() -> AsyncIterator[None]:
    """Fail a test that leaves tasks running in its event loop: every task must belong to a
    task group, or be awaited, before the test ends."""
    yield
    current = asyncio.current_task()
    # One turn of the loop lets tasks that were just cancelled or finished settle.
    await asyncio.sleep(0)
    left = [task for task in asyncio.all_tasks() if task is not current and not task.done()]
    if not left:
        return
    names = ", ".join(sorted(repr(task.get_coro()) for task in left))
    for task in left:
        task.cancel()
    await asyncio.gather(*left, return_exceptions=True)
    pytest.fail(f"the test left {len(left)} task(s) running: {names}")


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, Any, Any]:
    """Collect what a failed test left behind before its report is written: the finalizers of
    sockets and transports it left open would otherwise run during the report's source
    parsing, which CPython 3.11 turns into "SystemError: AST constructor recursion depth
    mismatch" and an INTERNALERROR that ends the whole run."""
    if call.excinfo is not None:
        gc.collect()
    return (yield)


@pytest.fixture
def fake() -> Iterator[FakeApiServer]:
    """A fake API server on loopback that knows this node (``NODE``)."""
    with FakeApiServer() as server:
        server.add_node(NODE)
        yield server


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A directory with a short path, for unix sockets: their paths are limited to 107 bytes,
    which pytest's own temporary paths may pass."""
    path = Path(tempfile.mkdtemp(prefix="nq-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def executor() -> Iterator[ThreadPoolExecutor]:
    """The worker threads the plugin runs its hooks in. Shut down without waiting: a test may
    leave a hook hanging on purpose."""
    pool = ThreadPoolExecutor(max_workers=4)
    yield pool
    pool.shutdown(wait=False, cancel_futures=True)
