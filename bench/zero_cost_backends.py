"""Zero-cost simulated backends: an ArService that answers at once with valid token rows and DenoiserServices
that return a fixed tiny image at once. They let a benchmark or a test measure the gateway and the REST front
alone, with real gRPC servers (health, reflection, the shared interceptor) but no model.

    python -m bench.zero_cost_backends --denoisers 4 --ready-file /tmp/backends.json

The ready file gets {"ar": "host:port", "denoisers": ["host:port", ...]} once every server is SERVING; the
process then runs until SIGTERM or SIGINT. No torch is imported.
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import io
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from PIL import Image

from glmimage.v1 import (
    ar_service_pb2,
    ar_service_pb2_grpc,
    common_pb2,
    denoiser_service_pb2,
    denoiser_service_pb2_grpc,
)
from runtime.logs import configure_logging
from runtime.server import GrpcServer, install_shutdown_signals, start_server

log = logging.getLogger("bench.zero_cost_backends")

AR_SERVICE = ar_service_pb2.DESCRIPTOR.services_by_name["ArService"].full_name
DENOISER_SERVICE = denoiser_service_pb2.DESCRIPTOR.services_by_name["DenoiserService"].full_name
DEFAULT_STEPS = 4
VOCAB = 16384  # token ids stay below this, like a real visual codebook
_PIL_FORMATS = {common_pb2.IMAGE_FORMAT_PNG: "PNG", common_pb2.IMAGE_FORMAT_JPEG: "JPEG",
                common_pb2.IMAGE_FORMAT_WEBP: "WEBP"}


def _round32(pixels: int) -> int:
    return max(32, -(-pixels // 32) * 32)


@functools.lru_cache(maxsize=64)
def token_row(height: int, width: int) -> common_pb2.TokenRow:
    """(height/16) * (width/16) ids for a size already rounded to multiples of 32; cached per size."""
    return common_pb2.TokenRow(token_ids=[i % VOCAB for i in range((height // 16) * (width // 16))])


def prompt_tokens(prompt: str) -> int:
    # A stand-in for a tokenizer: deterministic, so tests can predict it (chat template + ~4 bytes per token).
    return 8 + len(prompt.encode()) // 4


class ZeroCostAr(ar_service_pb2_grpc.ArServiceServicer):
    """Answers Generate and GenerateBatch at once. `cached_tokens` is reported per output (capped at the prompt)."""

    def __init__(self, cached_tokens: int = 0) -> None:
        self.cached_tokens = cached_tokens

    def _generate(self, r: ar_service_pb2.GenerateRequest) -> ar_service_pb2.GenerateResponse:
        height, width = _round32(r.height or 256), _round32(r.width or 256)
        row = token_row(height, width)
        prompt = prompt_tokens(r.prompt)
        completion = len(row.token_ids) + 1  # the grid plus the end token
        usage = common_pb2.Usage(prompt_tokens=prompt, completion_tokens=completion,
                                 total_tokens=prompt + completion, cached_tokens=min(self.cached_tokens, prompt))
        n = r.n or 1
        base_seed = r.seed if r.HasField("seed") else 0
        outputs = [ar_service_pb2.PriorOutput(tokens=row, seed=base_seed + i, usage=usage) for i in range(n)]
        total = common_pb2.Usage(prompt_tokens=prompt * n, completion_tokens=completion * n,
                                 total_tokens=(prompt + completion) * n, cached_tokens=usage.cached_tokens * n)
        return ar_service_pb2.GenerateResponse(outputs=outputs, height=height, width=width, grid_height=height // 16,
                                               grid_width=width // 16, usage=total)

    async def Generate(self, request, context):
        return self._generate(request)

    async def GenerateBatch(self, request, context):
        return ar_service_pb2.GenerateBatchResponse(responses=[self._generate(r) for r in request.requests])


@functools.lru_cache(maxsize=8)
def fixed_image(output_format: int) -> bytes:
    """A 16x16 grey image in the requested format, encoded once."""
    buf = io.BytesIO()
    Image.new("RGB", (16, 16), (128, 128, 128)).save(buf, format=_PIL_FORMATS.get(output_format, "PNG"))
    return buf.getvalue()


class ZeroCostDenoiser(denoiser_service_pb2_grpc.DenoiserServiceServicer):
    """Answers Denoise with the fixed image at once; DenoiseStream adds per-step progress and partials."""

    def _result(self, job: denoiser_service_pb2.DenoiseRequest) -> denoiser_service_pb2.DenoiseResponse:
        output_format = job.output_format or common_pb2.IMAGE_FORMAT_PNG
        return denoiser_service_pb2.DenoiseResponse(
            image=fixed_image(output_format), output_format=output_format, height=job.height, width=job.width,
            steps_completed=job.num_inference_steps or DEFAULT_STEPS, seed=job.seed)

    async def Denoise(self, request, context):
        return self._result(request)

    async def DenoiseStream(self, request, context) -> AsyncIterator[denoiser_service_pb2.DenoiseStreamResponse]:
        job = request.job
        steps = job.num_inference_steps or DEFAULT_STEPS
        partials = min(request.partial_images, steps)
        # Previews after evenly spaced steps, the last one before the final step.
        partial_steps = {max(1, steps * (k + 1) // (partials + 1)): k for k in range(partials)}
        image = fixed_image(job.output_format or common_pb2.IMAGE_FORMAT_PNG)
        for step in range(1, steps + 1):
            yield denoiser_service_pb2.DenoiseStreamResponse(
                progress=denoiser_service_pb2.DenoiseProgress(step=step, total_steps=steps))
            if step in partial_steps:
                yield denoiser_service_pb2.DenoiseStreamResponse(partial_image=denoiser_service_pb2.PartialImage(
                    partial_image_index=partial_steps[step], step=step, image=image))
        yield denoiser_service_pb2.DenoiseStreamResponse(result=self._result(job))


@dataclass
class Backends:
    ar: GrpcServer
    denoisers: list[GrpcServer]
    ar_servicer: ZeroCostAr
    host: str

    @property
    def ar_address(self) -> str:
        return f"{self.host}:{self.ar.port}"

    @property
    def denoiser_addresses(self) -> list[str]:
        return [f"{self.host}:{d.port}" for d in self.denoisers]

    async def stop(self) -> None:
        await asyncio.gather(*(s.stop(None) for s in (self.ar, *self.denoisers)))


async def start_backends(host: str = "127.0.0.1", denoisers: int = 1, cached_tokens: int = 0) -> Backends:
    """One AR and `denoisers` denoiser servers on ephemeral ports, all SERVING."""
    ar_servicer = ZeroCostAr(cached_tokens)
    ar = await start_server(lambda s: ar_service_pb2_grpc.add_ArServiceServicer_to_server(ar_servicer, s),
                            [AR_SERVICE], f"{host}:0")
    servers = [ar]
    for _ in range(denoisers):
        servicer = ZeroCostDenoiser()
        servers.append(await start_server(
            lambda s, servicer=servicer: denoiser_service_pb2_grpc.add_DenoiserServiceServicer_to_server(
                servicer, s),
            [DENOISER_SERVICE], f"{host}:0"))
    for server in servers:
        await server.set_serving(True)
    return Backends(ar=ar, denoisers=servers[1:], ar_servicer=ar_servicer, host=host)


async def _serve(args: argparse.Namespace) -> None:
    stop = install_shutdown_signals()
    backends = await start_backends(args.host, args.denoisers, args.cached_tokens)
    ready = {"ar": backends.ar_address, "denoisers": backends.denoiser_addresses}
    log.info("zero-cost backends up: %s", ready)
    if args.ready_file is not None:
        tmp = args.ready_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(ready))
        tmp.replace(args.ready_file)  # atomic: readers never see half a file
    await stop.wait()
    await backends.stop()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--denoisers", type=int, default=4, help="denoiser servers (the gateway runs one job on each)")
    p.add_argument("--cached-tokens", type=int, default=0, help="cached prompt tokens the AR reports per output")
    p.add_argument("--ready-file", type=Path, default=None)
    p.add_argument("--log-level", default="WARNING")
    args = p.parse_args(argv)
    configure_logging(args.log_level)
    asyncio.run(_serve(args))


if __name__ == "__main__":
    main()
