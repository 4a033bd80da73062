"""`python -m gateway`: the gRPC GatewayService with its scheduler."""
from __future__ import annotations

import argparse
import asyncio
import logging

from gateway.config import GatewayConfig
from gateway.driver import Driver
from gateway.scheduler import SchedulerConfig
from gateway.servicer import GatewayServicer
from glmimage.v1 import gateway_service_pb2, gateway_service_pb2_grpc
from services.runtime.logs import configure_logging
from services.runtime.metrics import serve_metrics
from services.runtime.server import announce, common_server_args, run_until_signalled, start_server

log = logging.getLogger("gateway")
SERVICE_NAME = gateway_service_pb2.DESCRIPTOR.services_by_name["GatewayService"].full_name


def _size(text: str) -> tuple[int, int]:
    w, _, h = text.lower().partition("x")
    return int(w), int(h)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    d = SchedulerConfig()
    p = argparse.ArgumentParser(description="GLM-Image gateway: schedules requests over AR and denoiser pools",
                                parents=[common_server_args(50050)])
    p.add_argument("--ar", action="append", default=[], metavar="HOST:PORT", help="AR server (repeatable)")
    p.add_argument("--denoiser", action="append", default=[], metavar="HOST:PORT",
                   help="denoiser server (repeatable)")
    p.add_argument("--default-size", type=_size, default=(256, 256), metavar="WxH")
    p.add_argument("--request-timeout", type=float, default=300.0, help="seconds, when the client sets none")
    p.add_argument("--max-queued-outputs", type=int, default=d.max_queued_outputs)
    p.add_argument("--ar-batch-max-outputs", type=int, default=d.ar_batch_max_outputs)
    p.add_argument("--ar-batch-delay-ms", type=float, default=d.ar_batch_delay * 1000)
    p.add_argument("--ar-max-inflight-batches", type=int, default=d.ar_max_inflight_batches)
    p.add_argument("--ar-retries", type=int, default=d.ar_retries)
    p.add_argument("--max-attempts", type=int, default=d.max_attempts)
    return p.parse_args(argv)


def config_from(args: argparse.Namespace) -> GatewayConfig:
    width, height = args.default_size
    return GatewayConfig(
        ar_addresses=tuple(args.ar), denoiser_addresses=tuple(args.denoiser),
        scheduler=SchedulerConfig(max_queued_outputs=args.max_queued_outputs,
                                  ar_batch_max_outputs=args.ar_batch_max_outputs,
                                  ar_batch_delay=args.ar_batch_delay_ms / 1000,
                                  ar_max_inflight_batches=args.ar_max_inflight_batches,
                                  ar_retries=args.ar_retries, max_attempts=args.max_attempts),
        default_height=height, default_width=width, request_timeout=args.request_timeout)


async def serve(args: argparse.Namespace) -> None:
    config = config_from(args)
    driver = Driver(config)
    servicer = GatewayServicer(driver, config)
    server = await start_server(lambda s: gateway_service_pb2_grpc.add_GatewayServiceServicer_to_server(servicer, s),
                                [SERVICE_NAME], f"{args.host}:{args.port}")
    await driver.start()
    announce(server, args, "GatewayService")
    serve_metrics(args.host, args.metrics_port)
    # The gateway itself is ready at once; whether workers are available is reported by GetStatus and /health.
    await server.set_serving(True)
    try:
        await run_until_signalled(server, grace=args.drain_seconds)
    finally:
        await driver.close()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    configure_logging(args.log_level)
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()
