"""`python -m services.ar`: the AR server."""
from __future__ import annotations

import argparse
import asyncio
import functools

from glmimage.v1 import ar_service_pb2, ar_service_pb2_grpc
from services.ar.engine import ArEngine, ArLimits
from services.ar.servicer import ArServicer
from services.model.serving import model_args, serve_model
from services.runtime.logs import configure_logging
from services.runtime.server import common_server_args

SERVICE_NAME = ar_service_pb2.DESCRIPTOR.services_by_name["ArService"].full_name


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="GLM-Image AR server (prompt -> prior tokens)",
                                parents=[common_server_args(50051), model_args()])
    p.add_argument("--max-prompt-chars", type=int, default=ArLimits.max_prompt_chars)
    p.add_argument("--max-pixels", type=int, default=ArLimits.max_pixels)
    p.add_argument("--max-n", type=int, default=ArLimits.max_n)
    p.add_argument("--max-batch-outputs", type=int, default=ArLimits.max_batch_outputs)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    configure_logging(args.log_level)
    limits = ArLimits(max_prompt_chars=args.max_prompt_chars, max_pixels=args.max_pixels, max_n=args.max_n,
                      max_batch_outputs=args.max_batch_outputs)
    asyncio.run(serve_model(
        args, name="ar-engine", service_name=SERVICE_NAME,
        load=functools.partial(ArEngine.load, args.model_path, args.device, args.dtype, limits),
        make_servicer=ArServicer, register=ar_service_pb2_grpc.add_ArServiceServicer_to_server))


if __name__ == "__main__":
    main()
