"""Hostile OCI hook executables in the configuration, refused with errors naming the key,
everywhere: hooks that anyone but root could replace, relative, missing, writable by others,
owned by another user, behind symbolic links and chains of them, in directories others can write
to; and a running agent that keeps injecting the hook in force when a reload names such a one.

Each case is played the four ways of :mod:`tests.support.hostile_config`. Trusted hook paths
(through links, in sticky directories, through ``..``) pass: the loader, check-config and a reload
accept them (the daemon is not started for them: that is a whole agent).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import stat
from typing import Any

import pytest

from hooks.events import Event
from nri_plugin.cli import daemon
from nri_plugin.config.hook_paths import MAX_SYMLINKS, check_hook_path
from nri_plugin.sim.simulator import RuntimeSimulator
from protos import nri_api_pb2 as api
from tests.support.hostile_config import (
    HOOK_KEY,
    MONITOR_KEY,
    OTHER_UID,
    Case,
    Expected,
    Starts,
    Tree,
    check_config_names_every_problem,
    daemon_refuses_to_start,
    loader_names_every_problem,
    mode_text,
    reload_is_refused,
)

# Each case writes the configuration file (and whatever it names) and returns the errors expected,
# in the loader's order; an empty list means the file is valid.

def hook_relative(t: Tree) -> Expected:
    t.hook("bin/hook")
    return [f"{HOOK_KEY}: must be an absolute path, got 'bin/hook'"]


def hook_empty(t: Tree) -> Expected:
    t.hook("")
    return [f"{HOOK_KEY}: must be an absolute path, got ''"]


def hook_with_nul(t: Tree) -> Expected:
    # os.stat raised ValueError on an embedded NUL: a crash rather than an error.
    t.hook("/bin/sh\\u0000x")
    return [f"{HOOK_KEY}: must not contain a NUL character, got '/bin/sh\\x00x'"]


def hook_missing(t: Tree) -> Expected:
    t.hook(t.root / "nope")
    return [f"{HOOK_KEY}: {t.root}/nope: No such file or directory"]


def hook_in_a_missing_directory(t: Tree) -> Expected:
    t.hook(t.root / "nodir/hook")
    return [f"{HOOK_KEY}: {t.root}/nodir/hook: {t.root}/nodir: No such file or directory"]


def hook_through_a_file(t: Tree) -> Expected:
    exe = t.exe("hook")
    t.hook(f"{exe}/x")
    return [f"{HOOK_KEY}: {exe}/x: {exe}: not a directory"]


def hook_is_a_directory(t: Tree) -> Expected:
    d = t.dir("hooks")
    t.hook(d)
    return [f"{HOOK_KEY}: {d}: not a regular file"]


def hook_not_executable(t: Tree) -> Expected:
    exe = t.exe("hook", mode=0o644)
    t.hook(exe)
    return [f"{HOOK_KEY}: {exe}: not executable"]


def hook_owned_by_another_user(t: Tree) -> Expected:
    exe = t.exe("hook", uid=OTHER_UID)
    t.hook(exe)
    return [f"{HOOK_KEY}: {exe}: must be owned by root (uid 0), owner is uid {OTHER_UID}"]


def hook_group_writable(t: Tree) -> Expected:
    exe = t.exe("hook", mode=0o775)
    t.hook(exe)
    return [f"{HOOK_KEY}: {exe}: must not be group- or world-writable (mode "
            f"{mode_text(0o775)})"]


def hook_world_writable(t: Tree) -> Expected:
    exe = t.exe("hook", mode=0o757)
    t.hook(exe)
    return [f"{HOOK_KEY}: {exe}: must not be group- or world-writable (mode "
            f"{mode_text(0o757)})"]


def hook_symlink_to_a_world_writable_file(t: Tree) -> Expected:
    exe = t.exe("real", mode=0o777)
    link = t.link("hook", exe)
    t.hook(link)
    return [f"{HOOK_KEY}: {link} (-> {exe}): must not be group- or world-writable (mode "
            f"{mode_text(0o777)})"]


def hook_symlink_to_a_file_of_another_user(t: Tree) -> Expected:
    exe = t.exe("real", uid=OTHER_UID)
    link = t.link("hook", "real")
    t.hook(link)
    return [f"{HOOK_KEY}: {link} (-> {exe}): must be owned by root (uid 0), owner is uid "
            f"{OTHER_UID}"]


def hook_symlink_owned_by_another_user(t: Tree) -> Expected:
    exe = t.exe("real")
    link = t.link("hook", exe, uid=OTHER_UID)
    t.hook(link)
    return [f"{HOOK_KEY}: {link}: symbolic link {link} must be owned by root (uid 0), owner is "
            f"uid {OTHER_UID}"]


def hook_symlink_chain_to_a_group_writable_file(t: Tree) -> Expected:
    exe = t.exe("deep/real", mode=0o775)
    t.link("b", "deep/real")
    link = t.link("a", t.root / "b")
    t.hook(link)
    return [f"{HOOK_KEY}: {link} (-> {exe}): must not be group- or world-writable (mode "
            f"{mode_text(0o775)})"]


def hook_symlink_chain_through_a_link_of_another_user(t: Tree) -> Expected:
    t.exe("real")
    middle = t.link("b", "real", uid=OTHER_UID)
    link = t.link("a", "b")
    t.hook(link)
    return [f"{HOOK_KEY}: {link}: symbolic link {middle} must be owned by root (uid 0), owner is "
            f"uid {OTHER_UID}"]


def hook_symlink_loop(t: Tree) -> Expected:
    t.link("b", "a")
    link = t.link("a", "b")
    t.hook(link)
    return [f"{HOOK_KEY}: {link}: too many levels of symbolic links"]


def hook_symlink_chain_at_the_kernel_limit(t: Tree) -> Expected:
    exe = t.exe("real")
    previous = "real"
    for i in range(MAX_SYMLINKS):
        previous = t.link(f"l{i}", previous).name
    t.hook(t.root / previous)
    assert check_hook_path(str(exe)) is None
    return []


def hook_symlink_chain_over_the_kernel_limit(t: Tree) -> Expected:
    t.exe("real")
    previous = "real"
    for i in range(MAX_SYMLINKS + 1):
        previous = t.link(f"l{i}", previous).name
    t.hook(t.root / previous)
    return [f"{HOOK_KEY}: {t.root / previous}: too many levels of symbolic links"]


def hook_dangling_symlink(t: Tree) -> Expected:
    link = t.link("hook", "gone")
    t.hook(link)
    return [f"{HOOK_KEY}: {link}: {t.root}/gone: No such file or directory"]


def hook_in_a_world_writable_directory(t: Tree) -> Expected:
    d = t.dir("open", mode=0o777)
    exe = t.exe("open/hook")
    t.hook(exe)
    return [f"{HOOK_KEY}: {exe}: directory {d} must not be group- or world-writable unless "
            f"sticky (mode {mode_text(0o777, stat.S_IFDIR)})"]


def hook_in_a_group_writable_directory(t: Tree) -> Expected:
    d = t.dir("team", mode=0o775)
    exe = t.exe("team/sub/hook")
    t.hook(exe)
    return [f"{HOOK_KEY}: {exe}: directory {d} must not be group- or world-writable unless "
            f"sticky (mode {mode_text(0o775, stat.S_IFDIR)})"]


def hook_in_a_directory_of_another_user(t: Tree) -> Expected:
    d = t.dir("home", uid=OTHER_UID)
    exe = t.exe("home/hook")
    t.hook(exe)
    return [f"{HOOK_KEY}: {exe}: directory {d} must be owned by root (uid 0), owner is uid "
            f"{OTHER_UID}"]


def hook_behind_a_link_into_a_world_writable_directory(t: Tree) -> Expected:
    d = t.dir("open", mode=0o777)
    t.exe("open/hook")
    link = t.link("hook", "open/hook")
    t.hook(link)
    return [f"{HOOK_KEY}: {link}: directory {d} must not be group- or world-writable unless "
            f"sticky (mode {mode_text(0o777, stat.S_IFDIR)})"]


def hook_of_another_user_in_a_sticky_directory(t: Tree) -> Expected:
    t.dir("sticky", mode=0o1777)
    exe = t.exe("sticky/hook", uid=OTHER_UID)
    t.hook(exe)
    return [f"{HOOK_KEY}: {exe}: must be owned by root (uid 0), owner is uid {OTHER_UID}"]


def hook_of_root_in_a_sticky_directory(t: Tree) -> Expected:
    t.dir("sticky", mode=0o1777)
    t.hook(t.exe("sticky/hook"))
    return []


def hook_trusted_through_links_and_dot_dot(t: Tree) -> Expected:
    t.exe("bin/real")
    t.link("bin/hook", "../bin/./real")
    t.link("alias", "bin")
    t.hook(f"{t.root}/alias/../alias/hook")
    return []


def hook_system_shell(t: Tree) -> Expected:
    # /bin is a link to usr/bin on current distributions: a root-owned link to a root directory.
    t.hook("/bin/sh")
    return []


def monitor_hook_world_writable(t: Tree) -> Expected:
    exe = t.exe("monitor", mode=0o777)
    t.put(f'[resctrl.monitor_hook]\nenabled = true\npath = "{exe}"\n')
    return [f"{MONITOR_KEY}: {exe}: must not be group- or world-writable (mode "
            f"{mode_text(0o777)})"]


def every_problem_at_once(t: Tree) -> Expected:
    exe = t.exe("hook", mode=0o777)
    t.put(f'[plugin]\nstrict = 1\n[qos]\nsurprise = 2\n'
          f'[[oci_hooks.levels.reclaimed_cores.prestart]]\npath = "{exe}"\n')
    return ["plugin.strict: must be a boolean, got integer",
            Starts("qos.surprise: unknown key (known keys: "),
            f"{HOOK_KEY}: {exe}: must not be group- or world-writable (mode "
            f"{mode_text(0o777)})"]


CASES: list[Case] = [
    hook_relative, hook_empty, hook_with_nul, hook_missing, hook_in_a_missing_directory,
    hook_through_a_file, hook_is_a_directory, hook_not_executable, hook_owned_by_another_user,
    hook_group_writable, hook_world_writable, hook_symlink_to_a_world_writable_file,
    hook_symlink_to_a_file_of_another_user, hook_symlink_owned_by_another_user,
    hook_symlink_chain_to_a_group_writable_file, hook_symlink_chain_through_a_link_of_another_user,
    hook_symlink_loop, hook_symlink_chain_at_the_kernel_limit,
    hook_symlink_chain_over_the_kernel_limit, hook_dangling_symlink,
    hook_in_a_world_writable_directory, hook_in_a_group_writable_directory,
    hook_in_a_directory_of_another_user, hook_behind_a_link_into_a_world_writable_directory,
    hook_of_another_user_in_a_sticky_directory, hook_of_root_in_a_sticky_directory,
    hook_trusted_through_links_and_dot_dot, hook_system_shell, monitor_hook_world_writable,
    every_problem_at_once,
]


@pytest.mark.parametrize("case", CASES, ids=[c.__name__ for c in CASES])
def test_the_loader_names_every_problem(tree: Tree, case: Case) -> None:
    loader_names_every_problem(tree, case)


@pytest.mark.parametrize("case", CASES, ids=[c.__name__ for c in CASES])
def test_check_config_exits_1_with_one_line_per_error(
        tree: Tree, case: Case, capsys: pytest.CaptureFixture[str]) -> None:
    check_config_names_every_problem(tree, case, capsys)


@pytest.mark.parametrize("case", [c for c in CASES if c not in (
    hook_symlink_chain_at_the_kernel_limit, hook_of_root_in_a_sticky_directory,
    hook_trusted_through_links_and_dot_dot, hook_system_shell,)], ids=lambda c: c.__name__)
async def test_the_daemon_refuses_to_start(tree: Tree, case: Case,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    await daemon_refuses_to_start(tree, case, capsys)


@pytest.mark.parametrize("case", CASES, ids=[c.__name__ for c in CASES])
def test_a_reload_is_refused_and_the_running_config_stays(tree: Tree, case: Case) -> None:
    reload_is_refused(tree, case)




# --- a running agent ----------------------------------------------------------------------------

async def test_a_running_agent_refuses_an_untrusted_hook_and_keeps_injecting_the_old_one(
        tree: Tree, capsys: pytest.CaptureFixture[str]) -> None:
    """SIGHUP with a hook path anyone could replace: refused (the key named in the log), and the
    containers created afterwards get the hook of the configuration still in force; a trusted
    path then takes effect, so the refusal is what kept the old one."""
    base = ("[resctrl]\nenabled = false\n[reconciler]\nenabled = false\n"
            "[status]\nenabled = false\n[plugin]\nreconnect_initial_ms = 10\n")
    trusted = tree.exe("bin/trusted")
    replaced = tree.exe("bin/replacement")
    open_dir = tree.dir("open", mode=0o777)
    planted = tree.exe("open/planted")
    hook = '[[oci_hooks.levels.reclaimed_cores.prestart]]\npath = "{}"\n'
    tree.put(base + hook.format(trusted))
    socket_path = tree.root / "nri.sock"
    simulator = RuntimeSimulator(socket_path)
    await simulator.start()
    stop = asyncio.Event()
    lines: list[dict[str, Any]] = []

    async def logged(event: str, count: int = 1) -> dict[str, Any]:
        # Only the log tells: read it as it grows (the whole test runs within a bound).
        while len(found := [x for x in lines if x.get("event") == event]) < count:
            await asyncio.sleep(0.01)
            lines.extend(json.loads(line) for line in capsys.readouterr().err.splitlines()
                         if line.startswith("{"))
        return found[-1]

    async def hook_paths(n: int) -> list[str]:
        pod = api.PodSandbox(id=f"sb-{n}", uid=f"uid-{n}", name=f"p{n}", namespace="ns",
                             annotations={"qos.nri-qos.io/level": "reclaimed_cores"})
        container = api.Container(id=f"c-{n}", pod_sandbox_id=pod.id, name="app")
        answer = await simulator.send(connection, Event.CREATE_CONTAINER, pod, container)
        assert isinstance(answer, api.CreateContainerResponse)
        return [h.path for h in answer.adjust.hooks.prestart]

    try:
        async with asyncio.timeout(30), asyncio.TaskGroup() as group:
            serving = group.create_task(daemon.serve(str(tree.config), str(socket_path), None,
                                                     stop=stop, prelaunched=None))
            connection = await simulator.wait_ready()
            assert await hook_paths(1) == [str(trusted)]

            tree.put(base + hook.format(planted))
            os.kill(os.getpid(), signal.SIGHUP)
            rejected = await logged("config_rejected")
            assert rejected["errors"] == [
                f"{tree.config}: {HOOK_KEY}: {planted}: directory {open_dir} must not be group- or "
                f"world-writable unless sticky (mode {mode_text(0o777, stat.S_IFDIR)})"]
            assert await hook_paths(2) == [str(trusted)]

            tree.put(base + hook.format(replaced))
            os.kill(os.getpid(), signal.SIGHUP)
            assert (await logged("config_loaded", 2))["changed"] is True
            assert await hook_paths(3) == [str(replaced)]
            stop.set()
        assert serving.result() == 0
    finally:
        await simulator.stop()
