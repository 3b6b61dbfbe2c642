"""The uninstall Job may do what ``nri-qos reset`` does: give the processes of running
containers kubelet's ``oom_score_adj`` back (a write to the host's procfs; lowering a score needs
SYS_RESOURCE, as the DaemonSet's agent has it)."""

from __future__ import annotations

from tests.support.manifests import DEPLOY, yaml_docs


def test_the_reset_job_may_write_the_scores_it_gives_back() -> None:
    (job,) = yaml_docs((DEPLOY / "uninstall" / "reset-job.yaml").read_text())
    (container,) = job["spec"]["template"]["spec"]["containers"]
    volumes = {v["name"]: v for v in job["spec"]["template"]["spec"]["volumes"]}
    (proc,) = [m for m in container["volumeMounts"]
               if volumes[m["name"]].get("hostPath", {}).get("path") == "/proc"]
    assert proc["mountPath"] == "/host/proc"
    assert not proc.get("readOnly", False)
    added = container["securityContext"]["capabilities"]["add"]
    assert {"DAC_OVERRIDE", "SYS_RESOURCE"} <= set(added)
