"""The start-up sequence both model servers share: load, bind, warm up, SERVING, drain on SIGTERM."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc
import torch

from runtime.auth import add_internal_token_args, internal_token_interceptor, internal_tokens_from_args
from runtime.executor import SerialExecutor
from runtime.metrics import serve_metrics
from runtime.server import (
    announce,
    install_shutdown_signals,
    intake_from_args,
    run_until_signalled,
    start_server,
)
from runtime.tls import server_tls_from_args
from services.model.device import DEVICE_CHOICES, DTYPE_CHOICES

log = logging.getLogger(__name__)
T = TypeVar("T")


def model_args() -> argparse.ArgumentParser:
    """Flags every model server shares; use as an argparse parent."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--model-path", default=None,
                   help="GLM-Image checkpoint directory; default: the embedded tiny model (built offline)")
    p.add_argument("--device", default="auto", choices=DEVICE_CHOICES)
    p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES)
    p.add_argument("--torch-threads", type=int, default=0, help="0 keeps torch's default")
    add_internal_token_args(p, "require 'authorization: Bearer <token>' with one of these tokens on the model "
                               "service (the gateway's --internal-token-file); health and reflection stay open")
    return p


async def serve_model(
    args: argparse.Namespace,
    *,
    name: str,
    service_name: str,
    load: Callable[[], Any],
    make_servicer: Callable[[Any, SerialExecutor], Any],
    register: Callable[[Any, grpc.aio.Server], None],
    max_request_bytes: int,
) -> None:
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    tls = server_tls_from_args(args)  # flag errors before the (slow) model load
    intake = intake_from_args(args, max_request_bytes)
    # Signals are ours from here on: without this a SIGTERM while loading killed the process (exit 143) and a
    # SIGINT printed a KeyboardInterrupt traceback.
    stop = install_shutdown_signals()
    # Every token of the file is accepted (several during a rotation; see internal_tokens_from).
    tokens = internal_tokens_from_args(args)
    interceptors = [internal_token_interceptor(tokens, [service_name])] if tokens else []
    executor = SerialExecutor(name)
    # Load before binding, so nothing can reach a half-loaded model; health stays NOT_SERVING through warm-up.
    log.info("%s: loading the model", name)
    engine = await _unless_stopped(executor.run(load), stop)
    servicer = make_servicer(engine, executor)
    server = await start_server(lambda s: register(servicer, s), [service_name], f"{args.host}:{args.port}",
                                tls=tls, interceptors=interceptors, intake=intake)
    serve_metrics(args.host, args.metrics_port, args.metrics_port_file)  # before announce: see --metrics-port-file
    announce(server, args, service_name)
    if tokens:
        log.info("%s requires the internal token (%d accepted)", service_name, len(tokens))
    await _unless_stopped(executor.run(engine.warm_up), stop)
    await server.set_serving(True)
    log.info("%s SERVING", service_name)
    try:
        await run_until_signalled(server, grace=args.drain_seconds, stop=stop)
    finally:
        executor.shutdown()


async def _unless_stopped(work: Awaitable[T], stop: asyncio.Event) -> T:
    """The result of ``work`` (a start-up step), or, if SIGTERM/SIGINT comes first, the end of the process with
    exit code 0: nothing has been served yet, so there is nothing to drain, and a model load or warm-up running in
    its thread cannot be interrupted (a normal exit would wait for it: minutes with real weights)."""
    task = asyncio.ensure_future(work)
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        stopped.cancel()
        return task.result()
    log.info("shutdown requested during start-up: exiting without serving")
    logging.shutdown()  # flushes the handlers: os._exit skips that
    sys.stdout.flush()
    os._exit(0)
