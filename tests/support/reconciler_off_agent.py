"""The agent as the daemon builds it with the reconciler off, on a fake host, against the fake
API server: its one background service takes off the node what an earlier run left there."""

from __future__ import annotations

from pathlib import Path

from common.audit import AuditLog, MemoryAuditSink
from nri_plugin.agent import Agent, build_agent, probe
from nri_plugin.config.store import ConfigStore
from nri_plugin.session.stub import PluginIdentity
from tests.support.fake_apiserver import FakeApiServer, write_kubeconfig
from tests.support.fakesys import FakeHost


def agent_with_the_reconciler_off(tmp_path: Path, fake: FakeApiServer, node: str, *,
                                  request_timeout_s: float, sections: str = "") -> Agent:
    """``sections``: more of the configuration file (TOML), as retries' pace; the state
    directory is ``tmp_path / "state"``."""
    host = FakeHost(tmp_path / "host")
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", fake.url)
    config = tmp_path / "config.toml"
    config.write_text(f'[reconciler]\nenabled = false\nroot = "{host.root}"\n'
                      f'state_dir = "{tmp_path / "state"}"\n'
                      f'[kubernetes]\nkubeconfig = "{kubeconfig}"\nnode_name = "{node}"\n'
                      f"request_timeout_s = {request_timeout_s}\n"
                      f"{sections}"
                      "[status]\nenabled = false\n[metrics]\nenabled = false\n")
    audit = AuditLog(MemoryAuditSink())
    store = ConfigStore(audit)
    store.load_initial(config)
    host_info, sysfs = probe(store.current, audit)
    return build_agent(store, audit, host_info, sysfs, PluginIdentity("nri-qos", "10"),
                       run_background=True)
