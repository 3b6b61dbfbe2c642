"""Where the shipped ways of running nri-qos find their configuration: the uninstall Job loads
the drop-ins it mounts, as the DaemonSet's agent did; the systemd unit runs on the drop-ins of
/etc/nri-qos/config.toml.d without a main file, as the embedded defaults' install does."""

from __future__ import annotations

import configparser
import shutil
from pathlib import Path

from nri_plugin.cli.nri_qos import build_parser
from nri_plugin.config.schema import Config
from nri_plugin.config.store import DEFAULT_CONFIG_PATH, load_config
from tests.support.manifests import BASE, DEPLOY, Doc, container_of, one, yaml_docs

DROP_INS = DEFAULT_CONFIG_PATH + ".d"


def _config_mount(pod: Doc) -> str:
    (container,) = pod["containers"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    (path,) = [m["mountPath"] for m in container["volumeMounts"]
               if "configMap" in volumes[m["name"]]]
    return str(path)


def _loaded_in(root: Path, command: list[str]) -> Config:
    """The configuration ``command`` loads when ``root`` stands for the container's file system."""
    args = build_parser().parse_args(command[1:])

    def here(path: str) -> str:
        return str(root / path.lstrip("/"))

    cfg, _ = load_config(here(args.config) if args.config else None,
                         default_path=here(DEFAULT_CONFIG_PATH))
    return cfg


def test_the_reset_job_loads_the_drop_ins_it_mounts_as_the_agent_did(tmp_path: Path) -> None:
    (job,) = yaml_docs((DEPLOY / "uninstall" / "reset-job.yaml").read_text())
    job_pod = job["spec"]["template"]["spec"]
    daemonset = one(yaml_docs((BASE / "daemonset.yaml").read_text()), "DaemonSet")
    agent_pod = daemonset["spec"]["template"]["spec"]
    # Both see the drop-ins where the agent looks for them, and no main file beside them.
    assert _config_mount(job_pod) == _config_mount(agent_pod) == DROP_INS
    drop_ins = tmp_path / DROP_INS.lstrip("/")
    drop_ins.mkdir(parents=True)
    shutil.copy(BASE / "00-daemonset.toml", drop_ins)

    (reset,) = job_pod["containers"]
    in_the_job = _loaded_in(tmp_path, reset["command"])
    in_the_agent = _loaded_in(tmp_path, container_of(daemonset)["command"])
    assert in_the_job == in_the_agent
    assert in_the_job.reconciler.root == "/host"


def test_the_systemd_unit_runs_on_drop_ins_without_a_main_file(tmp_path: Path) -> None:
    """The README's install runs on the embedded defaults and switches to enforce with a drop-in
    alone: the unit must start on such a node, not exit at every restart for want of a file."""
    unit = configparser.ConfigParser(interpolation=None, strict=True)
    unit.read_string((DEPLOY / "nri-qos.service").read_text())
    drop_ins = tmp_path / DROP_INS.lstrip("/")
    drop_ins.mkdir(parents=True)
    (drop_ins / "90-enforce.toml").write_text('[agent]\nmode = "enforce"\n')
    (program, *args) = unit["Service"]["ExecStart"].split()
    assert _loaded_in(tmp_path, [program, *args]).agent.mode == "enforce"
    # And a main file, where there is one, is read with them.
    (tmp_path / DEFAULT_CONFIG_PATH.lstrip("/")).write_text("[plugin]\ndeadline_ms = 900\n")
    assert _loaded_in(tmp_path, [program, *args]).plugin.deadline_ms == 900
