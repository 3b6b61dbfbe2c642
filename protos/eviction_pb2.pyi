from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class QosLevel(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    QOS_LEVEL_UNSPECIFIED: _ClassVar[QosLevel]
    RECLAIMED_CORES: _ClassVar[QosLevel]
    SHARED_CORES: _ClassVar[QosLevel]
    DEDICATED_CORES: _ClassVar[QosLevel]
    SYSTEM_CORES: _ClassVar[QosLevel]

class MetType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    NOT_MET: _ClassVar[MetType]
    SOFT_MET: _ClassVar[MetType]
    HARD_MET: _ClassVar[MetType]

class ThresholdOperator(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OPERATOR_UNSPECIFIED: _ClassVar[ThresholdOperator]
    LESS_THAN: _ClassVar[ThresholdOperator]
    GREATER_THAN: _ClassVar[ThresholdOperator]

class ConditionType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CONDITION_TYPE_UNSPECIFIED: _ClassVar[ConditionType]
    NODE_CONDITION: _ClassVar[ConditionType]
QOS_LEVEL_UNSPECIFIED: QosLevel
RECLAIMED_CORES: QosLevel
SHARED_CORES: QosLevel
DEDICATED_CORES: QosLevel
SYSTEM_CORES: QosLevel
NOT_MET: MetType
SOFT_MET: MetType
HARD_MET: MetType
OPERATOR_UNSPECIFIED: ThresholdOperator
LESS_THAN: ThresholdOperator
GREATER_THAN: ThresholdOperator
CONDITION_TYPE_UNSPECIFIED: ConditionType
NODE_CONDITION: ConditionType

class Pod(_message.Message):
    __slots__ = ("uid", "namespace", "name", "qos_level", "priority", "memory_request_bytes", "memory_usage_bytes")
    UID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    QOS_LEVEL_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    MEMORY_REQUEST_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_USAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    uid: str
    namespace: str
    name: str
    qos_level: QosLevel
    priority: int
    memory_request_bytes: int
    memory_usage_bytes: int
    def __init__(self, uid: _Optional[str] = ..., namespace: _Optional[str] = ..., name: _Optional[str] = ..., qos_level: _Optional[_Union[QosLevel, str]] = ..., priority: _Optional[int] = ..., memory_request_bytes: _Optional[int] = ..., memory_usage_bytes: _Optional[int] = ...) -> None: ...

class Condition(_message.Message):
    __slots__ = ("type", "name", "met")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    MET_FIELD_NUMBER: _ClassVar[int]
    type: ConditionType
    name: str
    met: bool
    def __init__(self, type: _Optional[_Union[ConditionType, str]] = ..., name: _Optional[str] = ..., met: _Optional[bool] = ...) -> None: ...

class ThresholdMetRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ThresholdMetResponse(_message.Message):
    __slots__ = ("threshold_value", "observed_value", "threshold_operator", "met_type", "eviction_scope", "condition")
    THRESHOLD_VALUE_FIELD_NUMBER: _ClassVar[int]
    OBSERVED_VALUE_FIELD_NUMBER: _ClassVar[int]
    THRESHOLD_OPERATOR_FIELD_NUMBER: _ClassVar[int]
    MET_TYPE_FIELD_NUMBER: _ClassVar[int]
    EVICTION_SCOPE_FIELD_NUMBER: _ClassVar[int]
    CONDITION_FIELD_NUMBER: _ClassVar[int]
    threshold_value: float
    observed_value: float
    threshold_operator: ThresholdOperator
    met_type: MetType
    eviction_scope: str
    condition: Condition
    def __init__(self, threshold_value: _Optional[float] = ..., observed_value: _Optional[float] = ..., threshold_operator: _Optional[_Union[ThresholdOperator, str]] = ..., met_type: _Optional[_Union[MetType, str]] = ..., eviction_scope: _Optional[str] = ..., condition: _Optional[_Union[Condition, _Mapping]] = ...) -> None: ...

class GetTopEvictionPodsRequest(_message.Message):
    __slots__ = ("active_pods", "top_n", "eviction_scope")
    ACTIVE_PODS_FIELD_NUMBER: _ClassVar[int]
    TOP_N_FIELD_NUMBER: _ClassVar[int]
    EVICTION_SCOPE_FIELD_NUMBER: _ClassVar[int]
    active_pods: _containers.RepeatedCompositeFieldContainer[Pod]
    top_n: int
    eviction_scope: str
    def __init__(self, active_pods: _Optional[_Iterable[_Union[Pod, _Mapping]]] = ..., top_n: _Optional[int] = ..., eviction_scope: _Optional[str] = ...) -> None: ...

class GetTopEvictionPodsResponse(_message.Message):
    __slots__ = ("target_pod_uids", "grace_period_seconds")
    TARGET_POD_UIDS_FIELD_NUMBER: _ClassVar[int]
    GRACE_PERIOD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    target_pod_uids: _containers.RepeatedScalarFieldContainer[str]
    grace_period_seconds: int
    def __init__(self, target_pod_uids: _Optional[_Iterable[str]] = ..., grace_period_seconds: _Optional[int] = ...) -> None: ...

class GetEvictPodsRequest(_message.Message):
    __slots__ = ("active_pods",)
    ACTIVE_PODS_FIELD_NUMBER: _ClassVar[int]
    active_pods: _containers.RepeatedCompositeFieldContainer[Pod]
    def __init__(self, active_pods: _Optional[_Iterable[_Union[Pod, _Mapping]]] = ...) -> None: ...

class EvictPod(_message.Message):
    __slots__ = ("uid", "reason", "grace_period_seconds", "force")
    UID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    GRACE_PERIOD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    uid: str
    reason: str
    grace_period_seconds: int
    force: bool
    def __init__(self, uid: _Optional[str] = ..., reason: _Optional[str] = ..., grace_period_seconds: _Optional[int] = ..., force: _Optional[bool] = ...) -> None: ...

class GetEvictPodsResponse(_message.Message):
    __slots__ = ("evict_pods", "condition")
    EVICT_PODS_FIELD_NUMBER: _ClassVar[int]
    CONDITION_FIELD_NUMBER: _ClassVar[int]
    evict_pods: _containers.RepeatedCompositeFieldContainer[EvictPod]
    condition: Condition
    def __init__(self, evict_pods: _Optional[_Iterable[_Union[EvictPod, _Mapping]]] = ..., condition: _Optional[_Union[Condition, _Mapping]] = ...) -> None: ...
