from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ImageFormat(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    IMAGE_FORMAT_UNSPECIFIED: _ClassVar[ImageFormat]
    IMAGE_FORMAT_PNG: _ClassVar[ImageFormat]
    IMAGE_FORMAT_JPEG: _ClassVar[ImageFormat]
    IMAGE_FORMAT_WEBP: _ClassVar[ImageFormat]

class StepCache(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STEP_CACHE_UNSPECIFIED: _ClassVar[StepCache]
    STEP_CACHE_OFF: _ClassVar[StepCache]
    STEP_CACHE_BALANCED: _ClassVar[StepCache]
    STEP_CACHE_AGGRESSIVE: _ClassVar[StepCache]
IMAGE_FORMAT_UNSPECIFIED: ImageFormat
IMAGE_FORMAT_PNG: ImageFormat
IMAGE_FORMAT_JPEG: ImageFormat
IMAGE_FORMAT_WEBP: ImageFormat
STEP_CACHE_UNSPECIFIED: StepCache
STEP_CACHE_OFF: StepCache
STEP_CACHE_BALANCED: StepCache
STEP_CACHE_AGGRESSIVE: StepCache

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "total_tokens", "reasoning_tokens", "cached_tokens", "image_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REASONING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    IMAGE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    reasoning_tokens: int
    cached_tokens: int
    image_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., total_tokens: _Optional[int] = ..., reasoning_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., image_tokens: _Optional[int] = ...) -> None: ...

class TokenRow(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ReferenceImage(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    def __init__(self, data: _Optional[bytes] = ...) -> None: ...

class ReferenceTokens(_message.Message):
    __slots__ = ("tokens", "grid_height", "grid_width")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    GRID_HEIGHT_FIELD_NUMBER: _ClassVar[int]
    GRID_WIDTH_FIELD_NUMBER: _ClassVar[int]
    tokens: TokenRow
    grid_height: int
    grid_width: int
    def __init__(self, tokens: _Optional[_Union[TokenRow, _Mapping]] = ..., grid_height: _Optional[int] = ..., grid_width: _Optional[int] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ...) -> None: ...

class LoraRef(_message.Message):
    __slots__ = ("name", "scale")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SCALE_FIELD_NUMBER: _ClassVar[int]
    name: str
    scale: float
    def __init__(self, name: _Optional[str] = ..., scale: _Optional[float] = ...) -> None: ...

class LoraInfo(_message.Message):
    __slots__ = ("name", "description", "default_scale", "size_bytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_SCALE_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    default_scale: float
    size_bytes: int
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., default_scale: _Optional[float] = ..., size_bytes: _Optional[int] = ...) -> None: ...

class Limits(_message.Message):
    __slots__ = ("max_prompt_chars", "max_n", "max_pixels", "max_steps", "max_guidance", "max_batch_outputs", "max_partial_images", "max_reference_images", "max_reference_bytes", "max_reference_pixels", "max_reference_total_bytes", "step_cache", "max_loras_per_request", "max_lora_rank", "max_lora_bytes")
    MAX_PROMPT_CHARS_FIELD_NUMBER: _ClassVar[int]
    MAX_N_FIELD_NUMBER: _ClassVar[int]
    MAX_PIXELS_FIELD_NUMBER: _ClassVar[int]
    MAX_STEPS_FIELD_NUMBER: _ClassVar[int]
    MAX_GUIDANCE_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    MAX_PARTIAL_IMAGES_FIELD_NUMBER: _ClassVar[int]
    MAX_REFERENCE_IMAGES_FIELD_NUMBER: _ClassVar[int]
    MAX_REFERENCE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_REFERENCE_PIXELS_FIELD_NUMBER: _ClassVar[int]
    MAX_REFERENCE_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    STEP_CACHE_FIELD_NUMBER: _ClassVar[int]
    MAX_LORAS_PER_REQUEST_FIELD_NUMBER: _ClassVar[int]
    MAX_LORA_RANK_FIELD_NUMBER: _ClassVar[int]
    MAX_LORA_BYTES_FIELD_NUMBER: _ClassVar[int]
    max_prompt_chars: int
    max_n: int
    max_pixels: int
    max_steps: int
    max_guidance: float
    max_batch_outputs: int
    max_partial_images: int
    max_reference_images: int
    max_reference_bytes: int
    max_reference_pixels: int
    max_reference_total_bytes: int
    step_cache: bool
    max_loras_per_request: int
    max_lora_rank: int
    max_lora_bytes: int
    def __init__(self, max_prompt_chars: _Optional[int] = ..., max_n: _Optional[int] = ..., max_pixels: _Optional[int] = ..., max_steps: _Optional[int] = ..., max_guidance: _Optional[float] = ..., max_batch_outputs: _Optional[int] = ..., max_partial_images: _Optional[int] = ..., max_reference_images: _Optional[int] = ..., max_reference_bytes: _Optional[int] = ..., max_reference_pixels: _Optional[int] = ..., max_reference_total_bytes: _Optional[int] = ..., step_cache: _Optional[bool] = ..., max_loras_per_request: _Optional[int] = ..., max_lora_rank: _Optional[int] = ..., max_lora_bytes: _Optional[int] = ...) -> None: ...

class ImageSize(_message.Message):
    __slots__ = ("width", "height")
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    width: int
    height: int
    def __init__(self, width: _Optional[int] = ..., height: _Optional[int] = ...) -> None: ...

class BuildInfo(_message.Message):
    __slots__ = ("version", "git_commit", "proto_revision", "min_proto_revision")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    GIT_COMMIT_FIELD_NUMBER: _ClassVar[int]
    PROTO_REVISION_FIELD_NUMBER: _ClassVar[int]
    MIN_PROTO_REVISION_FIELD_NUMBER: _ClassVar[int]
    version: str
    git_commit: str
    proto_revision: int
    min_proto_revision: int
    def __init__(self, version: _Optional[str] = ..., git_commit: _Optional[str] = ..., proto_revision: _Optional[int] = ..., min_proto_revision: _Optional[int] = ...) -> None: ...
