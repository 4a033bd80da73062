from glmimage.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ArServiceGetLimitsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ArServiceGetLimitsResponse(_message.Message):
    __slots__ = ("limits", "build", "device")
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    BUILD_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    limits: _common_pb2.Limits
    build: _common_pb2.BuildInfo
    device: str
    def __init__(self, limits: _Optional[_Union[_common_pb2.Limits, _Mapping]] = ..., build: _Optional[_Union[_common_pb2.BuildInfo, _Mapping]] = ..., device: _Optional[str] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "n", "height", "width", "seed", "sampling", "request_id", "reference_images")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_IMAGES_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    n: int
    height: int
    width: int
    seed: int
    sampling: _common_pb2.SamplingParams
    request_id: str
    reference_images: _containers.RepeatedCompositeFieldContainer[_common_pb2.ReferenceImage]
    def __init__(self, prompt: _Optional[str] = ..., n: _Optional[int] = ..., height: _Optional[int] = ..., width: _Optional[int] = ..., seed: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., request_id: _Optional[str] = ..., reference_images: _Optional[_Iterable[_Union[_common_pb2.ReferenceImage, _Mapping]]] = ...) -> None: ...

class PriorOutput(_message.Message):
    __slots__ = ("tokens", "seed", "usage")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    tokens: _common_pb2.TokenRow
    seed: int
    usage: _common_pb2.Usage
    def __init__(self, tokens: _Optional[_Union[_common_pb2.TokenRow, _Mapping]] = ..., seed: _Optional[int] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("outputs", "height", "width", "grid_height", "grid_width", "usage", "references")
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    GRID_HEIGHT_FIELD_NUMBER: _ClassVar[int]
    GRID_WIDTH_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    REFERENCES_FIELD_NUMBER: _ClassVar[int]
    outputs: _containers.RepeatedCompositeFieldContainer[PriorOutput]
    height: int
    width: int
    grid_height: int
    grid_width: int
    usage: _common_pb2.Usage
    references: _containers.RepeatedCompositeFieldContainer[_common_pb2.ReferenceTokens]
    def __init__(self, outputs: _Optional[_Iterable[_Union[PriorOutput, _Mapping]]] = ..., height: _Optional[int] = ..., width: _Optional[int] = ..., grid_height: _Optional[int] = ..., grid_width: _Optional[int] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., references: _Optional[_Iterable[_Union[_common_pb2.ReferenceTokens, _Mapping]]] = ...) -> None: ...

class GenerateBatchRequest(_message.Message):
    __slots__ = ("requests",)
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[GenerateRequest]
    def __init__(self, requests: _Optional[_Iterable[_Union[GenerateRequest, _Mapping]]] = ...) -> None: ...

class GenerateBatchResponse(_message.Message):
    __slots__ = ("responses", "queue_seconds")
    RESPONSES_FIELD_NUMBER: _ClassVar[int]
    QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    responses: _containers.RepeatedCompositeFieldContainer[GenerateResponse]
    queue_seconds: float
    def __init__(self, responses: _Optional[_Iterable[_Union[GenerateResponse, _Mapping]]] = ..., queue_seconds: _Optional[float] = ...) -> None: ...
