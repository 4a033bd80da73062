"""`python -m services.denoiser`: a batch-1 denoiser server (DiT + VAE)."""
from __future__ import annotations

import argparse
import asyncio
import functools
from pathlib import Path

from glmimage.v1 import denoiser_service_pb2, denoiser_service_pb2_grpc
from runtime.errors import InvalidArgument
from runtime.limits import (
    DENOISER_FIELDS,
    Limits,
    add_limit_args,
    limits_from_args,
    max_request_bytes,
    model_size,
)
from runtime.logs import configure_logging
from runtime.server import common_server_args
from runtime.tracing import endpoint_from, setup_tracing
from services.denoiser.compiled import CompileSettings, parse_sizes
from services.denoiser.encoding import PNG_LEVELS
from services.denoiser.engine import DenoiseEngine, DenoiseSettings
from services.denoiser.servicer import DenoiserServicer
from services.denoiser.step_cache import DEFAULT_SCHEDULES, Schedule
from services.model.serving import model_args, serve_model

SERVICE_NAME = denoiser_service_pb2.DESCRIPTOR.services_by_name["DenoiserService"].full_name


def _schedule(spec: str) -> Schedule:
    try:
        return Schedule.parse(spec)
    except ValueError as exc:  # argparse shows an ArgumentTypeError's own text
        raise argparse.ArgumentTypeError(str(exc)) from None


def _sizes(spec: str) -> tuple[tuple[int, int], ...]:
    try:
        return parse_sizes(spec)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="GLM-Image denoiser server (prior tokens -> image), batch 1",
                                parents=[common_server_args(50061), model_args()], allow_abbrev=False)
    p.add_argument("--default-steps", type=int, default=DenoiseSettings.default_steps,
                   help="steps when the request gives none (the tiny model needs 2; real weights ~50)")
    p.add_argument("--default-guidance", type=float, default=DenoiseSettings.default_guidance)
    add_limit_args(p, DENOISER_FIELDS)
    p.add_argument("--png-compress-level", type=int, default=DenoiseSettings.png_compress_level, choices=PNG_LEVELS,
                   metavar="0-9",
                   help="zlib level for PNG when the request gives no output_compression: lower is faster and larger")
    for level, schedule in DEFAULT_SCHEDULES.items():
        p.add_argument(f"--step-cache-{level.value}", type=_schedule, default=schedule, metavar="SPEC",
                       help=f"the {level.value} step-cache level's schedule: the first `warmup` steps computed, then "
                            f"one in every `interval`, the rest extrapolated (Taylor `order`; `lite`=1 skips every "
                            f"block and extrapolates only the output) (default {schedule.spec()})")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the DiT's repeated blocks and warm up --compile-sizes before SERVING "
                        "(off by default: on a CPU it does not pay; see docs/configuration.md)")
    p.add_argument("--compile-sizes", type=_sizes, default=CompileSettings.sizes, metavar="WxH,...",
                   help="sizes warmed up (compiled) before SERVING with --compile; another size may compile in its "
                        "first request (default: 64x64,256x256, the warm-up's and the gateway's default)")
    p.add_argument("--compile-references", type=int, default=CompileSettings.references, metavar="N",
                   help="warm up edits of 1..N references with --compile (default %(default)s)")
    p.add_argument("--compile-backend", default=CompileSettings.backend,
                   help="torch.compile backend with --compile (default %(default)s)")
    p.add_argument("--lora-dir", type=Path, default=None,
                   help="directory of LoRA adapters a job may name (NAME.safetensors or NAME/ in diffusers' layout, "
                        "optional NAME.json sidecar); default: none, or the tiny model's demo adapter without "
                        "--model-path")
    p.add_argument("--max-loaded-loras", type=int, default=DenoiseSettings.max_loaded_loras,
                   help="adapters held loaded in the DiT at once, the least recently used evicted first "
                        f"(default {DenoiseSettings.max_loaded_loras})")
    args = p.parse_args(argv)
    if args.max_loaded_loras < 1:
        p.error("--max-loaded-loras must be at least 1")
    if args.lora_dir is not None and not args.lora_dir.is_dir():
        p.error(f"--lora-dir {args.lora_dir}: not a directory")
    try:
        args.limits = Limits(**limits_from_args(args, DENOISER_FIELDS))
    except SystemExit as exc:
        p.error(str(exc))
    if args.default_steps > args.limits.max_steps or args.default_steps < 1:
        p.error(f"--default-steps must be between 1 and --max-steps ({args.limits.max_steps})")
    for height, width in args.compile_sizes:
        try:
            model_size(height, width, args.limits)
        except InvalidArgument as exc:
            p.error(f"--compile-sizes: {width}x{height}: {exc}")
    if not 0 <= args.compile_references <= args.limits.max_reference_images:
        p.error(f"--compile-references must be between 0 and --max-reference-images "
                f"({args.limits.max_reference_images})")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    configure_logging(args.log_level)
    setup_tracing("glmimage-denoiser", endpoint_from(args.otlp_endpoint))
    settings = DenoiseSettings(limits=args.limits, default_steps=args.default_steps,
                               default_guidance=args.default_guidance, png_compress_level=args.png_compress_level,
                               step_cache={level: getattr(args, f"step_cache_{level.value}")
                                           for level in DEFAULT_SCHEDULES},
                               compile=CompileSettings(sizes=args.compile_sizes, references=args.compile_references,
                                                       backend=args.compile_backend) if args.compile else None,
                               lora_dir=args.lora_dir, max_loaded_loras=args.max_loaded_loras)
    asyncio.run(serve_model(
        args, name="denoise-engine", service_name=SERVICE_NAME,
        load=functools.partial(DenoiseEngine.load, args.model_path, args.device, args.dtype, settings),
        make_servicer=DenoiserServicer,
        register=denoiser_service_pb2_grpc.add_DenoiserServiceServicer_to_server,
        # A job carries the edit's references with their tokens beside the target's.
        max_request_bytes=max_request_bytes(args.limits, tokens=True)))


if __name__ == "__main__":
    main()
