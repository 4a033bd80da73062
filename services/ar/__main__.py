"""`python -m services.ar`: the AR server."""
from __future__ import annotations

import argparse
import asyncio
import functools
import logging

from glmimage.v1 import ar_service_pb2, ar_service_pb2_grpc
from runtime.errors import ServiceError
from runtime.limits import AR_FIELDS, Limits, add_limit_args, limits_from_args, max_request_bytes
from runtime.logs import configure_logging
from runtime.server import common_server_args
from runtime.tracing import endpoint_from, setup_tracing
from services.ar.engine import ArEngine
from services.ar.servicer import DEFAULT_MERGE_WINDOW, ArServicer
from services.ar.srt_backend import SrtBackend
from services.model.device import DeviceUnavailable
from services.model.loading import CheckpointError
from services.model.serving import model_args, serve_model

SERVICE_NAME = ar_service_pb2.DESCRIPTOR.services_by_name["ArService"].full_name

log = logging.getLogger(__name__)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(allow_abbrev=False, description="GLM-Image AR server (prompt -> prior tokens)",
                                parents=[common_server_args(50051), model_args()])
    add_limit_args(p, AR_FIELDS)
    p.add_argument("--max-queue", type=int, default=0,
                   help="calls allowed to wait for the model beyond the running one (0: no limit); "
                        "more get RESOURCE_EXHAUSTED")
    p.add_argument("--merge-window-ms", type=float, default=DEFAULT_MERGE_WINDOW * 1000,
                   help="a model batch waits up to this long for concurrent calls of its resolution to merge with, "
                        "up to --max-batch-outputs rows (0: merge only calls already waiting)")
    p.add_argument("--backend", choices=("local", "srt"), default="local",
                   help="local: run the model here; srt: forward to an sglang-style HTTP /generate server")
    p.add_argument("--srt-url", default=None, help="with --backend srt: the server's base URL")
    p.add_argument("--srt-timeout", type=float, default=600.0, help="seconds per HTTP call to the srt server")
    args = p.parse_args(argv)
    if args.backend == "srt" and not args.srt_url:
        p.error("--backend srt needs --srt-url")
    try:
        args.limits = Limits(**limits_from_args(args, AR_FIELDS))
    except SystemExit as exc:
        p.error(str(exc))
    if args.max_queue < 0:
        p.error("--max-queue must be 0 (no limit) or more")
    if args.merge_window_ms < 0:
        p.error("--merge-window-ms must be 0 or more")
    return args


async def run(args: argparse.Namespace) -> None:
    """Serve until SIGTERM; a device, checkpoint or backend problem at start-up ends the process with its message,
    not a traceback."""
    limits = args.limits
    if args.backend == "srt":
        load = functools.partial(SrtBackend.load, args.model_path, args.srt_url, limits, timeout=args.srt_timeout)
    else:
        load = functools.partial(ArEngine.load, args.model_path, args.device, args.dtype, limits)
    try:
        await serve_model(
            args, name="ar-engine", service_name=SERVICE_NAME, load=load,
            make_servicer=functools.partial(ArServicer, max_queue=args.max_queue,
                                            merge_window=args.merge_window_ms / 1000),
            register=ar_service_pb2_grpc.add_ArServiceServicer_to_server,
            # A batch carries up to max_batch_outputs prompts, or one edit with its references.
            max_request_bytes=max_request_bytes(limits, prompts=limits.max_batch_outputs))
    except (DeviceUnavailable, CheckpointError, ServiceError) as exc:  # e.g. an srt server that is not up
        log.error("%s", exc)
        raise SystemExit(f"services.ar: {exc}") from None


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    configure_logging(args.log_level)
    setup_tracing("glmimage-ar", endpoint_from(args.otlp_endpoint))
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
