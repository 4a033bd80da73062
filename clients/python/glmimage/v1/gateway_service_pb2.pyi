from glmimage.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ResponseFormat(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RESPONSE_FORMAT_UNSPECIFIED: _ClassVar[ResponseFormat]
    RESPONSE_FORMAT_BYTES: _ClassVar[ResponseFormat]
    RESPONSE_FORMAT_URL: _ClassVar[ResponseFormat]

class Priority(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PRIORITY_UNSPECIFIED: _ClassVar[Priority]
    PRIORITY_INTERACTIVE: _ClassVar[Priority]
    PRIORITY_DEFAULT: _ClassVar[Priority]
    PRIORITY_BATCH: _ClassVar[Priority]

class WorkerState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_STATE_UNSPECIFIED: _ClassVar[WorkerState]
    WORKER_STATE_AVAILABLE: _ClassVar[WorkerState]
    WORKER_STATE_BUSY: _ClassVar[WorkerState]
    WORKER_STATE_UNHEALTHY: _ClassVar[WorkerState]
    WORKER_STATE_DRAINING: _ClassVar[WorkerState]

class WorkerRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_ROLE_UNSPECIFIED: _ClassVar[WorkerRole]
    WORKER_ROLE_AR: _ClassVar[WorkerRole]
    WORKER_ROLE_DENOISER: _ClassVar[WorkerRole]
RESPONSE_FORMAT_UNSPECIFIED: ResponseFormat
RESPONSE_FORMAT_BYTES: ResponseFormat
RESPONSE_FORMAT_URL: ResponseFormat
PRIORITY_UNSPECIFIED: Priority
PRIORITY_INTERACTIVE: Priority
PRIORITY_DEFAULT: Priority
PRIORITY_BATCH: Priority
WORKER_STATE_UNSPECIFIED: WorkerState
WORKER_STATE_AVAILABLE: WorkerState
WORKER_STATE_BUSY: WorkerState
WORKER_STATE_UNHEALTHY: WorkerState
WORKER_STATE_DRAINING: WorkerState
WORKER_ROLE_UNSPECIFIED: WorkerRole
WORKER_ROLE_AR: WorkerRole
WORKER_ROLE_DENOISER: WorkerRole

class GenerateImagesRequest(_message.Message):
    __slots__ = ("prompt", "n", "height", "width", "output_format", "output_compression", "num_inference_steps", "guidance_scale", "seed", "sampling", "request_id", "reference_images", "step_cache", "loras", "priority", "response_format")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FORMAT_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    NUM_INFERENCE_STEPS_FIELD_NUMBER: _ClassVar[int]
    GUIDANCE_SCALE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_IMAGES_FIELD_NUMBER: _ClassVar[int]
    STEP_CACHE_FIELD_NUMBER: _ClassVar[int]
    LORAS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FORMAT_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    n: int
    height: int
    width: int
    output_format: _common_pb2.ImageFormat
    output_compression: int
    num_inference_steps: int
    guidance_scale: float
    seed: int
    sampling: _common_pb2.SamplingParams
    request_id: str
    reference_images: _containers.RepeatedCompositeFieldContainer[_common_pb2.ReferenceImage]
    step_cache: _common_pb2.StepCache
    loras: _containers.RepeatedCompositeFieldContainer[_common_pb2.LoraRef]
    priority: Priority
    response_format: ResponseFormat
    def __init__(self, prompt: _Optional[str] = ..., n: _Optional[int] = ..., height: _Optional[int] = ..., width: _Optional[int] = ..., output_format: _Optional[_Union[_common_pb2.ImageFormat, str]] = ..., output_compression: _Optional[int] = ..., num_inference_steps: _Optional[int] = ..., guidance_scale: _Optional[float] = ..., seed: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., request_id: _Optional[str] = ..., reference_images: _Optional[_Iterable[_Union[_common_pb2.ReferenceImage, _Mapping]]] = ..., step_cache: _Optional[_Union[_common_pb2.StepCache, str]] = ..., loras: _Optional[_Iterable[_Union[_common_pb2.LoraRef, _Mapping]]] = ..., priority: _Optional[_Union[Priority, str]] = ..., response_format: _Optional[_Union[ResponseFormat, str]] = ...) -> None: ...

class GeneratedImage(_message.Message):
    __slots__ = ("index", "image", "seed", "usage", "url", "url_expires_at", "steps_cached", "step_cache_note")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    URL_FIELD_NUMBER: _ClassVar[int]
    URL_EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    STEPS_CACHED_FIELD_NUMBER: _ClassVar[int]
    STEP_CACHE_NOTE_FIELD_NUMBER: _ClassVar[int]
    index: int
    image: bytes
    seed: int
    usage: _common_pb2.Usage
    url: str
    url_expires_at: int
    steps_cached: int
    step_cache_note: str
    def __init__(self, index: _Optional[int] = ..., image: _Optional[bytes] = ..., seed: _Optional[int] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., url: _Optional[str] = ..., url_expires_at: _Optional[int] = ..., steps_cached: _Optional[int] = ..., step_cache_note: _Optional[str] = ...) -> None: ...

class GenerateImagesResponse(_message.Message):
    __slots__ = ("images", "usage", "height", "width", "output_format", "request_id")
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FORMAT_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    images: _containers.RepeatedCompositeFieldContainer[GeneratedImage]
    usage: _common_pb2.Usage
    height: int
    width: int
    output_format: _common_pb2.ImageFormat
    request_id: str
    def __init__(self, images: _Optional[_Iterable[_Union[GeneratedImage, _Mapping]]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., height: _Optional[int] = ..., width: _Optional[int] = ..., output_format: _Optional[_Union[_common_pb2.ImageFormat, str]] = ..., request_id: _Optional[str] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetLimitsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetLimitsResponse(_message.Message):
    __slots__ = ("limits",)
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    limits: _common_pb2.Limits
    def __init__(self, limits: _Optional[_Union[_common_pb2.Limits, _Mapping]] = ...) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("address", "role", "state", "inflight", "current_job", "health", "stuck", "held_elsewhere", "health_detail", "loras_loaded", "step", "total_steps", "incompatible", "build", "device", "compiled_sizes")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    CURRENT_JOB_FIELD_NUMBER: _ClassVar[int]
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    STUCK_FIELD_NUMBER: _ClassVar[int]
    HELD_ELSEWHERE_FIELD_NUMBER: _ClassVar[int]
    HEALTH_DETAIL_FIELD_NUMBER: _ClassVar[int]
    LORAS_LOADED_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOTAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    INCOMPATIBLE_FIELD_NUMBER: _ClassVar[int]
    BUILD_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    COMPILED_SIZES_FIELD_NUMBER: _ClassVar[int]
    address: str
    role: WorkerRole
    state: WorkerState
    inflight: int
    current_job: str
    health: str
    stuck: bool
    held_elsewhere: bool
    health_detail: str
    loras_loaded: _containers.RepeatedScalarFieldContainer[str]
    step: int
    total_steps: int
    incompatible: bool
    build: _common_pb2.BuildInfo
    device: str
    compiled_sizes: _containers.RepeatedCompositeFieldContainer[_common_pb2.ImageSize]
    def __init__(self, address: _Optional[str] = ..., role: _Optional[_Union[WorkerRole, str]] = ..., state: _Optional[_Union[WorkerState, str]] = ..., inflight: _Optional[int] = ..., current_job: _Optional[str] = ..., health: _Optional[str] = ..., stuck: _Optional[bool] = ..., held_elsewhere: _Optional[bool] = ..., health_detail: _Optional[str] = ..., loras_loaded: _Optional[_Iterable[str]] = ..., step: _Optional[int] = ..., total_steps: _Optional[int] = ..., incompatible: _Optional[bool] = ..., build: _Optional[_Union[_common_pb2.BuildInfo, _Mapping]] = ..., device: _Optional[str] = ..., compiled_sizes: _Optional[_Iterable[_Union[_common_pb2.ImageSize, _Mapping]]] = ...) -> None: ...

class GetStatusResponse(_message.Message):
    __slots__ = ("pending_ar_requests", "pending_ar_outputs", "pending_denoise_outputs", "active_requests", "workers", "tenants", "gateway_build")
    PENDING_AR_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PENDING_AR_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    PENDING_DENOISE_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    GATEWAY_BUILD_FIELD_NUMBER: _ClassVar[int]
    pending_ar_requests: int
    pending_ar_outputs: int
    pending_denoise_outputs: int
    active_requests: int
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    tenants: _containers.RepeatedCompositeFieldContainer[TenantStatus]
    gateway_build: _common_pb2.BuildInfo
    def __init__(self, pending_ar_requests: _Optional[int] = ..., pending_ar_outputs: _Optional[int] = ..., pending_denoise_outputs: _Optional[int] = ..., active_requests: _Optional[int] = ..., workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ..., tenants: _Optional[_Iterable[_Union[TenantStatus, _Mapping]]] = ..., gateway_build: _Optional[_Union[_common_pb2.BuildInfo, _Mapping]] = ...) -> None: ...

class TenantStatus(_message.Message):
    __slots__ = ("name", "weight", "pending_ar_requests", "pending_denoise_outputs", "active_requests", "inflight_images", "oldest_wait_seconds", "requests_total", "images_total", "requests_per_minute", "images_per_minute", "max_inflight_images", "remaining_requests", "remaining_images", "max_priority")
    NAME_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    PENDING_AR_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PENDING_DENOISE_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_IMAGES_FIELD_NUMBER: _ClassVar[int]
    OLDEST_WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    IMAGES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_PER_MINUTE_FIELD_NUMBER: _ClassVar[int]
    IMAGES_PER_MINUTE_FIELD_NUMBER: _ClassVar[int]
    MAX_INFLIGHT_IMAGES_FIELD_NUMBER: _ClassVar[int]
    REMAINING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    REMAINING_IMAGES_FIELD_NUMBER: _ClassVar[int]
    MAX_PRIORITY_FIELD_NUMBER: _ClassVar[int]
    name: str
    weight: float
    pending_ar_requests: int
    pending_denoise_outputs: int
    active_requests: int
    inflight_images: int
    oldest_wait_seconds: float
    requests_total: int
    images_total: int
    requests_per_minute: int
    images_per_minute: int
    max_inflight_images: int
    remaining_requests: int
    remaining_images: int
    max_priority: Priority
    def __init__(self, name: _Optional[str] = ..., weight: _Optional[float] = ..., pending_ar_requests: _Optional[int] = ..., pending_denoise_outputs: _Optional[int] = ..., active_requests: _Optional[int] = ..., inflight_images: _Optional[int] = ..., oldest_wait_seconds: _Optional[float] = ..., requests_total: _Optional[int] = ..., images_total: _Optional[int] = ..., requests_per_minute: _Optional[int] = ..., images_per_minute: _Optional[int] = ..., max_inflight_images: _Optional[int] = ..., remaining_requests: _Optional[int] = ..., remaining_images: _Optional[int] = ..., max_priority: _Optional[_Union[Priority, str]] = ...) -> None: ...

class GenerateImagesStreamRequest(_message.Message):
    __slots__ = ("request", "partial_images")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_IMAGES_FIELD_NUMBER: _ClassVar[int]
    request: GenerateImagesRequest
    partial_images: int
    def __init__(self, request: _Optional[_Union[GenerateImagesRequest, _Mapping]] = ..., partial_images: _Optional[int] = ...) -> None: ...

class ImageProgress(_message.Message):
    __slots__ = ("image_index", "step", "total_steps")
    IMAGE_INDEX_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOTAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    image_index: int
    step: int
    total_steps: int
    def __init__(self, image_index: _Optional[int] = ..., step: _Optional[int] = ..., total_steps: _Optional[int] = ...) -> None: ...

class ImagePartial(_message.Message):
    __slots__ = ("image_index", "partial_image_index", "image")
    IMAGE_INDEX_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_IMAGE_INDEX_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    image_index: int
    partial_image_index: int
    image: bytes
    def __init__(self, image_index: _Optional[int] = ..., partial_image_index: _Optional[int] = ..., image: _Optional[bytes] = ...) -> None: ...

class GenerateImagesStreamResponse(_message.Message):
    __slots__ = ("progress", "partial_image", "completed")
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_IMAGE_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_FIELD_NUMBER: _ClassVar[int]
    progress: ImageProgress
    partial_image: ImagePartial
    completed: GenerateImagesResponse
    def __init__(self, progress: _Optional[_Union[ImageProgress, _Mapping]] = ..., partial_image: _Optional[_Union[ImagePartial, _Mapping]] = ..., completed: _Optional[_Union[GenerateImagesResponse, _Mapping]] = ...) -> None: ...

class AddWorkerRequest(_message.Message):
    __slots__ = ("address", "role")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    address: str
    role: WorkerRole
    def __init__(self, address: _Optional[str] = ..., role: _Optional[_Union[WorkerRole, str]] = ...) -> None: ...

class AddWorkerResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RemoveWorkerRequest(_message.Message):
    __slots__ = ("address",)
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    address: str
    def __init__(self, address: _Optional[str] = ...) -> None: ...

class RemoveWorkerResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListLorasRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LoraPlacement(_message.Message):
    __slots__ = ("worker", "loaded", "error")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    LOADED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    worker: str
    loaded: _containers.RepeatedScalarFieldContainer[str]
    error: str
    def __init__(self, worker: _Optional[str] = ..., loaded: _Optional[_Iterable[str]] = ..., error: _Optional[str] = ...) -> None: ...

class ListLorasResponse(_message.Message):
    __slots__ = ("loras", "placement")
    LORAS_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    loras: _containers.RepeatedCompositeFieldContainer[_common_pb2.LoraInfo]
    placement: _containers.RepeatedCompositeFieldContainer[LoraPlacement]
    def __init__(self, loras: _Optional[_Iterable[_Union[_common_pb2.LoraInfo, _Mapping]]] = ..., placement: _Optional[_Iterable[_Union[LoraPlacement, _Mapping]]] = ...) -> None: ...

class LoadLorasRequest(_message.Message):
    __slots__ = ("names", "workers")
    NAMES_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    names: _containers.RepeatedScalarFieldContainer[str]
    workers: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, names: _Optional[_Iterable[str]] = ..., workers: _Optional[_Iterable[str]] = ...) -> None: ...

class LoadLorasResponse(_message.Message):
    __slots__ = ("placement",)
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    placement: _containers.RepeatedCompositeFieldContainer[LoraPlacement]
    def __init__(self, placement: _Optional[_Iterable[_Union[LoraPlacement, _Mapping]]] = ...) -> None: ...

class UnloadLorasRequest(_message.Message):
    __slots__ = ("names", "workers")
    NAMES_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    names: _containers.RepeatedScalarFieldContainer[str]
    workers: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, names: _Optional[_Iterable[str]] = ..., workers: _Optional[_Iterable[str]] = ...) -> None: ...

class UnloadLorasResponse(_message.Message):
    __slots__ = ("placement",)
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    placement: _containers.RepeatedCompositeFieldContainer[LoraPlacement]
    def __init__(self, placement: _Optional[_Iterable[_Union[LoraPlacement, _Mapping]]] = ...) -> None: ...
