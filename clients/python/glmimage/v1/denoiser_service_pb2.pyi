from glmimage.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DenoiserServiceListLorasRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DenoiserServiceListLorasResponse(_message.Message):
    __slots__ = ("available", "loaded")
    AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    LOADED_FIELD_NUMBER: _ClassVar[int]
    available: _containers.RepeatedCompositeFieldContainer[_common_pb2.LoraInfo]
    loaded: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, available: _Optional[_Iterable[_Union[_common_pb2.LoraInfo, _Mapping]]] = ..., loaded: _Optional[_Iterable[str]] = ...) -> None: ...

class DenoiserServiceLoadLorasRequest(_message.Message):
    __slots__ = ("names",)
    NAMES_FIELD_NUMBER: _ClassVar[int]
    names: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, names: _Optional[_Iterable[str]] = ...) -> None: ...

class DenoiserServiceLoadLorasResponse(_message.Message):
    __slots__ = ("loaded",)
    LOADED_FIELD_NUMBER: _ClassVar[int]
    loaded: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, loaded: _Optional[_Iterable[str]] = ...) -> None: ...

class DenoiserServiceUnloadLorasRequest(_message.Message):
    __slots__ = ("names",)
    NAMES_FIELD_NUMBER: _ClassVar[int]
    names: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, names: _Optional[_Iterable[str]] = ...) -> None: ...

class DenoiserServiceUnloadLorasResponse(_message.Message):
    __slots__ = ("loaded",)
    LOADED_FIELD_NUMBER: _ClassVar[int]
    loaded: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, loaded: _Optional[_Iterable[str]] = ...) -> None: ...

class WatchOccupancyRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WatchOccupancyResponse(_message.Message):
    __slots__ = ("sequence", "busy", "owner", "request_id", "loras_loaded", "step", "total_steps")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    BUSY_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LORAS_LOADED_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOTAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    busy: bool
    owner: str
    request_id: str
    loras_loaded: _containers.RepeatedScalarFieldContainer[str]
    step: int
    total_steps: int
    def __init__(self, sequence: _Optional[int] = ..., busy: _Optional[bool] = ..., owner: _Optional[str] = ..., request_id: _Optional[str] = ..., loras_loaded: _Optional[_Iterable[str]] = ..., step: _Optional[int] = ..., total_steps: _Optional[int] = ...) -> None: ...

class DenoiserServiceGetLimitsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DenoiserServiceGetLimitsResponse(_message.Message):
    __slots__ = ("limits", "build", "device", "compiled_sizes")
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    BUILD_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    COMPILED_SIZES_FIELD_NUMBER: _ClassVar[int]
    limits: _common_pb2.Limits
    build: _common_pb2.BuildInfo
    device: str
    compiled_sizes: _containers.RepeatedCompositeFieldContainer[_common_pb2.ImageSize]
    def __init__(self, limits: _Optional[_Union[_common_pb2.Limits, _Mapping]] = ..., build: _Optional[_Union[_common_pb2.BuildInfo, _Mapping]] = ..., device: _Optional[str] = ..., compiled_sizes: _Optional[_Iterable[_Union[_common_pb2.ImageSize, _Mapping]]] = ...) -> None: ...

class DenoiseRequest(_message.Message):
    __slots__ = ("prompt", "prior_tokens", "height", "width", "num_inference_steps", "guidance_scale", "seed", "output_format", "output_compression", "request_id", "reference_images", "references", "owner", "step_cache", "loras")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PRIOR_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    NUM_INFERENCE_STEPS_FIELD_NUMBER: _ClassVar[int]
    GUIDANCE_SCALE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FORMAT_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_IMAGES_FIELD_NUMBER: _ClassVar[int]
    REFERENCES_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    STEP_CACHE_FIELD_NUMBER: _ClassVar[int]
    LORAS_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    prior_tokens: _common_pb2.TokenRow
    height: int
    width: int
    num_inference_steps: int
    guidance_scale: float
    seed: int
    output_format: _common_pb2.ImageFormat
    output_compression: int
    request_id: str
    reference_images: _containers.RepeatedCompositeFieldContainer[_common_pb2.ReferenceImage]
    references: _containers.RepeatedCompositeFieldContainer[_common_pb2.ReferenceTokens]
    owner: str
    step_cache: _common_pb2.StepCache
    loras: _containers.RepeatedCompositeFieldContainer[_common_pb2.LoraRef]
    def __init__(self, prompt: _Optional[str] = ..., prior_tokens: _Optional[_Union[_common_pb2.TokenRow, _Mapping]] = ..., height: _Optional[int] = ..., width: _Optional[int] = ..., num_inference_steps: _Optional[int] = ..., guidance_scale: _Optional[float] = ..., seed: _Optional[int] = ..., output_format: _Optional[_Union[_common_pb2.ImageFormat, str]] = ..., output_compression: _Optional[int] = ..., request_id: _Optional[str] = ..., reference_images: _Optional[_Iterable[_Union[_common_pb2.ReferenceImage, _Mapping]]] = ..., references: _Optional[_Iterable[_Union[_common_pb2.ReferenceTokens, _Mapping]]] = ..., owner: _Optional[str] = ..., step_cache: _Optional[_Union[_common_pb2.StepCache, str]] = ..., loras: _Optional[_Iterable[_Union[_common_pb2.LoraRef, _Mapping]]] = ...) -> None: ...

class DenoiseTimings(_message.Message):
    __slots__ = ("denoise_seconds", "decode_seconds", "encode_seconds", "prepare_seconds", "lora_load_seconds")
    DENOISE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DECODE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ENCODE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREPARE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LORA_LOAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    denoise_seconds: float
    decode_seconds: float
    encode_seconds: float
    prepare_seconds: float
    lora_load_seconds: float
    def __init__(self, denoise_seconds: _Optional[float] = ..., decode_seconds: _Optional[float] = ..., encode_seconds: _Optional[float] = ..., prepare_seconds: _Optional[float] = ..., lora_load_seconds: _Optional[float] = ...) -> None: ...

class DenoiseResponse(_message.Message):
    __slots__ = ("image", "output_format", "height", "width", "steps_completed", "seed", "timings", "steps_cached", "step_cache_note")
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FORMAT_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    STEPS_COMPLETED_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    STEPS_CACHED_FIELD_NUMBER: _ClassVar[int]
    STEP_CACHE_NOTE_FIELD_NUMBER: _ClassVar[int]
    image: bytes
    output_format: _common_pb2.ImageFormat
    height: int
    width: int
    steps_completed: int
    seed: int
    timings: DenoiseTimings
    steps_cached: int
    step_cache_note: str
    def __init__(self, image: _Optional[bytes] = ..., output_format: _Optional[_Union[_common_pb2.ImageFormat, str]] = ..., height: _Optional[int] = ..., width: _Optional[int] = ..., steps_completed: _Optional[int] = ..., seed: _Optional[int] = ..., timings: _Optional[_Union[DenoiseTimings, _Mapping]] = ..., steps_cached: _Optional[int] = ..., step_cache_note: _Optional[str] = ...) -> None: ...

class DenoiseStreamRequest(_message.Message):
    __slots__ = ("job", "partial_images")
    JOB_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_IMAGES_FIELD_NUMBER: _ClassVar[int]
    job: DenoiseRequest
    partial_images: int
    def __init__(self, job: _Optional[_Union[DenoiseRequest, _Mapping]] = ..., partial_images: _Optional[int] = ...) -> None: ...

class DenoiseProgress(_message.Message):
    __slots__ = ("step", "total_steps")
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOTAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    step: int
    total_steps: int
    def __init__(self, step: _Optional[int] = ..., total_steps: _Optional[int] = ...) -> None: ...

class PartialImage(_message.Message):
    __slots__ = ("partial_image_index", "step", "image")
    PARTIAL_IMAGE_INDEX_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    partial_image_index: int
    step: int
    image: bytes
    def __init__(self, partial_image_index: _Optional[int] = ..., step: _Optional[int] = ..., image: _Optional[bytes] = ...) -> None: ...

class DenoiseStreamResponse(_message.Message):
    __slots__ = ("progress", "partial_image", "result")
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_IMAGE_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    progress: DenoiseProgress
    partial_image: PartialImage
    result: DenoiseResponse
    def __init__(self, progress: _Optional[_Union[DenoiseProgress, _Mapping]] = ..., partial_image: _Optional[_Union[PartialImage, _Mapping]] = ..., result: _Optional[_Union[DenoiseResponse, _Mapping]] = ...) -> None: ...
