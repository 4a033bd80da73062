"""The limits in force, as the REST front knows them, and what it does with them.

The gateway's GetLimits is the source (what some worker of each stage can run, within the gateway's flags); this front
reads it at start and every REFRESH_S seconds after. With it the front refuses, naming the REST ``param``, what
the gateway would refuse anyway, without a round trip, and /openapi.json advertises it (``maxLength``,
``maximum``). Until the gateway answers, the defaults of runtime.limits stand in: the gateway still
checks every request itself, so a stale copy here can only refuse early what the gateway refuses too, or let
through what it then refuses.
"""
from __future__ import annotations

import asyncio
import copy
import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import grpc

from glmimage.v1 import gateway_service_pb2
from runtime.errors import InvalidArgument
from runtime.limits import (
    MAX_ASPECT,
    SEED_SPACE,
    Limits,
    float_text,
    from_proto,
)

from .errors import APIError, param_of

log = logging.getLogger("glmimage.rest")

REFRESH_S = 2.0


class LimitsCache:
    """The last limits the gateway reported (the defaults before it has)."""

    def __init__(self) -> None:
        self.current = Limits()
        self.from_gateway = False

    async def refresh(self, stubs: Any | Sequence[Any], timeout: float) -> None:
        """Read the limits from the first of ``stubs`` (one gateway's stub, or several) that answers."""
        for stub in stubs if isinstance(stubs, Sequence) else [stubs]:
            try:
                reply = await stub.GetLimits(gateway_service_pb2.GetLimitsRequest(), timeout=timeout)
                break
            except grpc.aio.AioRpcError as err:  # away or older: keep what we have, the gateway checks anyway
                log.debug("gateway GetLimits: %s", err.code().name)
        else:
            return
        limits = from_proto(reply.limits)
        if limits != self.current or not self.from_gateway:
            log.info("limits in force: %s", limits)
        self.current, self.from_gateway = limits, True

    async def follow(self, stubs: Any | Sequence[Any], timeout: float, interval: float = REFRESH_S) -> None:
        """Refresh every ``interval`` until cancelled (the app's lifespan, after its first refresh)."""
        while True:
            await asyncio.sleep(interval)
            await self.refresh(stubs, timeout)


@contextmanager
def as_api_error() -> Iterator[None]:
    """InvalidArgument -> OpenAI's 400 naming the REST ``param``."""
    try:
        yield
    except InvalidArgument as exc:
        param = param_of(exc.field or "")
        # height and width are one REST parameter: the message names it, `size` (the size itself is written WxH).
        message = f"size: {exc.description}" if param == "size" else str(exc)
        raise APIError(400, message, param=param, code="invalid_value") from None


def edit_body_bytes(limits: Limits, form_bytes: int) -> int:
    """The largest multipart edit body: every reference at its bound in all, plus ``form_bytes`` (the JSON body
    bound) for the text fields and the multipart framing."""
    return limits.max_reference_total_bytes + form_bytes


# REST field -> (JSON Schema keyword, the Limits value it advertises).
_ADVERTISED = {
    "prompt": ("maxLength", lambda lim: lim.max_prompt_chars),
    "n": ("maximum", lambda lim: lim.max_request_outputs),
    "num_inference_steps": ("maximum", lambda lim: lim.max_steps),
    # A float32 on the wire (30.010000228881836): advertised as set (30.01).
    "guidance_scale": ("maximum", lambda lim: float(float_text(lim.max_guidance))),
    "partial_images": ("maximum", lambda lim: lim.max_partial_images),
    "seed": ("maximum", lambda lim: SEED_SPACE - 1),
}


def with_limits(doc: dict[str, Any], limits: Limits,
                models: Sequence[str] = ("ImageGenerationRequest", "ImageEditRequest")) -> dict[str, Any]:
    """A copy of the OpenAPI document whose request schemas state ``limits``."""
    doc = copy.deepcopy(doc)
    for model in models:
        _state_limits(doc.get("components", {}).get("schemas", {}).get(model, {}).get("properties", {}), limits)
    return doc


def _state_limits(props: dict[str, Any], limits: Limits) -> None:
    for name, (keyword, value) in _ADVERTISED.items():
        if name not in props:
            continue
        # An optional field is anyOf [the typed schema, null]: the bound goes on the typed branch.
        for branch in props[name].get("anyOf", [props[name]]):
            if branch.get("type") in ("string", "integer", "number"):
                branch[keyword] = value(limits)
    if "image" in props:  # the edit's files
        props["image"]["maxItems"] = limits.max_reference_images
        props["image"]["x-max-bytes-each"] = limits.max_reference_bytes
        props["image"]["x-max-bytes-total"] = limits.max_reference_total_bytes
        props["image"]["x-max-pixels-each"] = limits.max_reference_pixels
    if "loras" in props:  # anyOf [the array, null]: the count goes on the array
        for branch in props["loras"].get("anyOf", [props["loras"]]):
            if branch.get("type") == "array":
                branch["maxItems"] = limits.max_loras_per_request
    if "size" in props:
        props["size"]["x-max-pixels"] = limits.max_pixels
        props["size"]["x-max-aspect"] = MAX_ASPECT
        props["size"]["description"] = (props["size"].get("description", "") +
                                        f" At most {limits.max_pixels} pixels after that rounding, and at most "
                                        f"{MAX_ASPECT:g}:1 (as the reference images).")
