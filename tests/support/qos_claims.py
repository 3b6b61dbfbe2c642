"""The QoS level claims a pod may and may not make: one table for the agent's policy
(``hooks.qos_level``) and the admission policy shipped in ``deploy/admission``.

Each case: the pod's Kubernetes QoS class, its namespace, where the claim is written (annotation
or label key), the value, the level the value names, and whether the claim stands.
"""

from __future__ import annotations

from dataclasses import dataclass

OURS = "qos.nri-qos.io/level"
KATALYST = "katalyst.kubewharf.io/qos_level"
KOORD = "koordinator.sh/qosClass"
VOLCANO = "volcano.sh/qos-level"

# Kubernetes' spelling (status.qosClass) -> the agent's (from the cgroup parent).
CLASSES = {"BestEffort": "besteffort", "Burstable": "burstable", "Guaranteed": "guaranteed"}
CLASS_DEFAULT = {"BestEffort": "reclaimed_cores", "Burstable": "shared_cores",
                 "Guaranteed": "shared_cores"}


@dataclass(frozen=True)
class Claim:
    qos_class: str
    namespace: str
    # "annotation" or "label"
    kind: str
    key: str
    value: str
    level: str
    allowed: bool

    @property
    def id(self) -> str:
        return f"{self.qos_class}-{self.namespace}-{self.kind}:{self.key}={self.value!r}"


# (source key, kind, value) spellings of each level, as the pod's author may write them.
SPELLINGS: dict[str, list[tuple[str, str, str]]] = {
    "reclaimed_cores": [("annotation", OURS, "reclaimed_cores"), ("label", KOORD, "BE"),
                        ("annotation", VOLCANO, "be")],
    "shared_cores": [("annotation", KATALYST, "shared_cores"), ("annotation", KOORD, "LS"),
                     ("annotation", VOLCANO, "LS")],
    "dedicated_cores": [("annotation", KATALYST, "dedicated_cores"), ("label", KOORD, "LSE"),
                        ("annotation", KOORD, " lsr "), ("annotation", VOLCANO, "LC"),
                        ("annotation", VOLCANO, "HLS")],
    "system_cores": [("annotation", OURS, "system_cores"), ("annotation", KATALYST,
                                                             " system_cores\n"),
                     ("label", KOORD, "SYSTEM"), ("annotation", KOORD, "System")],
}

# The most privileged level a claim may name outside the namespaces listed for system_cores.
ALLOWED = {
    "BestEffort": {"reclaimed_cores"},
    "Burstable": {"reclaimed_cores", "shared_cores"},
    "Guaranteed": {"reclaimed_cores", "shared_cores", "dedicated_cores"},
}


def _cases() -> list[Claim]:
    cases = []
    for qos_class, allowed in ALLOWED.items():
        for namespace in ("batch", "kube-system"):
            for level, spellings in SPELLINGS.items():
                for kind, key, value in spellings:
                    ok = namespace == "kube-system" if level == "system_cores" \
                        else level in allowed
                    cases.append(Claim(qos_class, namespace, kind, key, value, level, ok))
    return cases


CASES = _cases()
