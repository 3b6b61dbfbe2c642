"""``nri-qos status`` with a configuration whose status socket is off: it says so, instead of
telling the operator that no agent runs and to start one."""

from __future__ import annotations

import io
import json
from pathlib import Path

from nri_plugin.cli.status import main_status


def _config(tmp_path: Path) -> Path:
    path = tmp_path / "config.toml"
    path.write_text(f'[status]\nenabled = false\nsocket = "{tmp_path / "status.sock"}"\n')
    return path


def test_a_configuration_without_the_status_socket_is_named_not_a_missing_agent(
        tmp_path: Path) -> None:
    config = _config(tmp_path)
    out, err = io.StringIO(), io.StringIO()
    assert main_status(str(config), None, as_json=False, out=out, err=err) == 1
    assert "no nri-qos agent is running" not in err.getvalue()
    assert "[status] enabled = false" in err.getvalue()
    assert str(config) in err.getvalue()


def test_the_json_form_says_the_same(tmp_path: Path) -> None:
    out, err = io.StringIO(), io.StringIO()
    assert main_status(str(_config(tmp_path)), None, as_json=True, out=out, err=err) == 1
    failure = json.loads(out.getvalue())
    assert "[status] enabled = false" in failure["error"]
    assert failure["socket"] == str(tmp_path / "status.sock")
