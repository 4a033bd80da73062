"""The REST front's settings (RestSettings) and their start-up checks."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from glmimage.wire.channels import split_addresses

# The REST names of the StepCache levels (glmimage.v1.common): STEP_CACHE_<NAME upper>.
STEP_CACHE_LEVELS = ("off", "balanced", "aggressive")
QUALITIES = ("low", "medium", "high", "auto")


@dataclass(frozen=True)
class QualityProfile:
    """What a `quality` name means: denoising steps (0: the denoiser's default) and a step-cache level."""

    steps: int
    step_cache: str = "off"

    def __post_init__(self) -> None:
        if self.steps < 0 or self.step_cache not in STEP_CACHE_LEVELS:
            raise ValueError(f"a quality profile needs steps >= 0 and a step cache among {STEP_CACHE_LEVELS}")

    def spec(self) -> str:
        return f"{self.steps}:{self.step_cache}"


def quality_profile_arg(text: str) -> tuple[str, QualityProfile]:
    """``NAME=STEPS[:STEP_CACHE]``, the --quality flag's form, e.g. ``low=10:aggressive``."""
    name, sep, value = text.partition("=")
    steps, _, cache = value.partition(":")
    if not sep or name not in QUALITIES or not steps.isdigit():
        raise ValueError(f"{text!r}: expected NAME=STEPS[:STEP_CACHE] with NAME one of {', '.join(QUALITIES)}")
    return name, QualityProfile(int(steps), cache or "off")


def _default_quality_profiles() -> dict[str, QualityProfile]:
    # Steps 0: the denoiser's default. `high` and `auto` never cache, so their images are the uncached ones.
    return {"low": QualityProfile(10, "aggressive"), "medium": QualityProfile(30, "balanced"),
            "high": QualityProfile(50), "auto": QualityProfile(0)}


# How generation calls authenticate to the gateway. forward: with the client's own Authorization header (the
# gateway checks every caller; both sides share the keys). own: with this front's --gateway-api-key, after the
# front has checked the client against its own --api-key list (separate key sets per hop).
GATEWAY_AUTH_MODES = ("forward", "own")


@dataclass(frozen=True)
class RestSettings:
    # One host:port, several comma-separated (calls go round robin, and one a gateway fails UNAVAILABLE goes to
    # the next), or one grpc target such as dns:///name:port (grpc's round_robin over what it resolves to, skipping
    # gateways that say NOT_SERVING; a call that fails UNAVAILABLE goes round again, once per other address).
    gateway_address: str = "127.0.0.1:50050"
    served_model: str = "glm-image"
    model_aliases: tuple[str, ...] = ("gpt-image-1", "dall-e-3")
    default_size: tuple[int, int] = (256, 256)  # (width, height)
    # `quality` -> steps and step cache; a request's num_inference_steps and step_cache override either.
    quality_profiles: Mapping[str, QualityProfile] = field(default_factory=_default_quality_profiles)
    api_keys: tuple[str, ...] = ()  # empty: auth off
    # Keys that may see the live pool page (/status) when api_keys are set: the gateway's admin keys.
    admin_keys: tuple[str, ...] = ()
    # The tenants file (runtime.tenants), instead of both key lists: any tenant's key may call the API, an
    # admin tenant's see the live pool page; SIGHUP reloads it.
    tenants_file: Path | None = None
    request_timeout: float = 300.0
    enable_cache_report: bool = False
    health_timeout: float = 5.0
    # Bearer key for REST's own gateway calls (GetStatus behind /health) when the gateway checks keys.
    # With gateway_auth "forward", generation calls carry the client's own Authorization header instead, so the
    # gateway checks the caller; with "own", they carry this key and the client's header stays here.
    gateway_api_key: str | None = None
    gateway_auth: str = "forward"  # "forward" or "own", see GATEWAY_AUTH_MODES
    # TLS to the gateway: on when any is set. CA: PEM roots to verify the gateway (None: system roots);
    # client cert and key (PEM, both or neither): mutual TLS.
    gateway_tls_ca: Path | None = None
    gateway_tls_client_cert: Path | None = None
    gateway_tls_client_key: Path | None = None
    # Name to check the gateway's certificate against, when it differs from the dialled host.
    gateway_tls_server_name: str | None = None
    # Largest request body accepted (413 above it): a generation body is a few KiB (prompts are at most 32000
    # characters), so 1 MiB leaves room without letting a client make the front hold megabytes.
    max_body_bytes: int = 1024 * 1024
    # Browser origins allowed to call the API (CORS); empty: CORS off, browsers block cross-origin calls.
    cors_origins: tuple[str, ...] = ()
    # The disk image store whose files this front serves at their signed links (the gateways' --image-store; an
    # s3:// store serves its own presigned links), and the links' HMAC key, the gateways' --url-secret-file (None:
    # $GLMIMAGE_URL_SECRET, else the default file of the cache directory, created once).
    image_store: Path | None = None
    url_secret_file: Path | None = None

    def __post_init__(self) -> None:
        split_addresses(self.gateway_address)  # raises ValueError when it names none
        if self.max_body_bytes <= 0:
            raise ValueError(f"the body limit must be positive, not {self.max_body_bytes}")
        if (self.gateway_tls_client_cert is None) != (self.gateway_tls_client_key is None):
            raise ValueError("gateway TLS: give the client certificate and its key together, or neither")
        if self.gateway_auth not in GATEWAY_AUTH_MODES:
            raise ValueError(f"gateway auth must be one of {', '.join(GATEWAY_AUTH_MODES)}, not {self.gateway_auth!r}")
        if self.gateway_auth == "own" and not self.gateway_api_key:
            raise ValueError("--gateway-auth own needs --gateway-api-key (or GLMIMAGE_GATEWAY_API_KEY): the key this "
                             "front presents to the gateway on every call")
        if self.tenants_file is not None and (self.api_keys or self.admin_keys):
            raise ValueError("--tenants replaces --api-key and --admin-key (and GLMIMAGE_API_KEYS, "
                             "GLMIMAGE_ADMIN_KEYS): every key is in the tenants file, an admin's with role = \"admin\"")
        if self.gateway_auth == "own" and not self.api_keys and self.tenants_file is None:
            raise ValueError("--gateway-auth own needs --api-key (or GLMIMAGE_API_KEYS) too: a front with no keys "
                             "of its own would let anyone generate with its gateway key")

    @property
    def gateway_addresses(self) -> list[str]:
        return split_addresses(self.gateway_address)

    @property
    def model_names(self) -> tuple[str, ...]:
        return (self.served_model, *self.model_aliases)

    @property
    def gateway_tls(self) -> bool:
        return any(p is not None for p in (self.gateway_tls_ca, self.gateway_tls_client_cert,
                                           self.gateway_tls_client_key, self.gateway_tls_server_name))
