"""`python -m gateway`: the gRPC GatewayService with its scheduler."""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal

import grpc

from gateway.auth import (
    ENV_ADMIN_KEYS,
    ENV_KEYS,
    JOB_SERVICE,
    GatewayAuth,
    admin_keys_from,
    api_keys_from,
    status_keys_from,
)
from gateway.config import GatewayConfig
from gateway.driver import Driver
from gateway.jobs.setup import JOBS_OFF, add_job_args, open_jobs
from gateway.membership import parse_allow_rule, split_host_port
from gateway.metrics import GatewayMetrics
from gateway.quota_store import REDIS_TIMEOUT_S, store_from_url
from gateway.quotas import Quotas
from gateway.scheduler.types import SchedulerConfig
from gateway.servicer import GatewayServicer
from gateway.tenancy import TenantGate
from gateway.timeouts import TimeoutPolicy
from glmimage.v1 import gateway_service_pb2, gateway_service_pb2_grpc, job_service_pb2_grpc
from glmimage.wire.sizes import size_arg
from runtime.auth import add_internal_token_args, bearer_metadata, internal_token_from_args
from runtime.limits import BOUNDS, Limits, add_limit_args, limits_from_args, max_request_bytes
from runtime.logs import configure_logging
from runtime.metrics import serve_metrics
from runtime.server import (
    announce,
    common_server_args,
    intake_from_args,
    run_until_signalled,
    start_server,
)
from runtime.tenants import TenantsError, TenantsFile, add_tenants_args, tenants_from_keys
from runtime.tls import client_tls_args, client_tls_from_args, server_tls_from_args
from runtime.tracing import endpoint_from, setup_tracing

log = logging.getLogger("gateway")
SERVICE_NAME = gateway_service_pb2.DESCRIPTOR.services_by_name["GatewayService"].full_name


def _target(text: str) -> str:
    try:
        split_host_port(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _timeout(text: str) -> float | None:
    if text == "auto":
        return None
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds or 'auto', got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError("a timeout must be positive")
    return value


def _allow_rule(text: str):
    try:
        return parse_allow_rule(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    d, g, t = SchedulerConfig(), GatewayConfig((), ()), TimeoutPolicy()
    # No abbreviated flags: "--internal-token S" must not be read as --internal-token-file and echo S in an error.
    p = argparse.ArgumentParser(description="GLM-Image gateway: schedules requests over AR and denoiser pools",
                                parents=[common_server_args(50050), client_tls_args()], allow_abbrev=False)
    p.add_argument("--ar", action="append", default=[], type=_target, metavar="HOST:PORT",
                   help="AR server (repeatable)")
    p.add_argument("--denoiser", action="append", default=[], type=_target, metavar="HOST:PORT",
                   help="denoiser server (repeatable)")
    p.add_argument("--ar-dns", action="append", default=[], type=_target, metavar="NAME:PORT",
                   help="DNS name whose A/AAAA records are the AR servers (repeatable; a headless Service)")
    p.add_argument("--denoiser-dns", action="append", default=[], type=_target, metavar="NAME:PORT",
                   help="DNS name whose A/AAAA records are the denoisers (repeatable; a headless Service)")
    p.add_argument("--dns-interval", type=float, default=5.0, help="seconds between DNS re-resolutions")
    p.add_argument("--default-size", type=size_arg, default=(256, 256), metavar="WxH")
    p.add_argument("--request-timeout", type=float, default=300.0, help="seconds, when the client sets none")
    p.add_argument("--max-queued-outputs", type=int, default=d.max_queued_outputs,
                   help="admission bound on the pending-AR queue, in output slots; past it RESOURCE_EXHAUSTED")
    p.add_argument("--ar-batch-max-outputs", type=int, default=d.ar_batch_max_outputs,
                   help="AR batch capacity in output slots")
    p.add_argument("--ar-batch-delay-ms", type=float, default=d.ar_batch_delay * 1000,
                   help="a batch leaves when full or when its oldest request waited this long")
    p.add_argument("--ar-max-inflight-batches", type=int, default=d.ar_max_inflight_batches,
                   help="batches in flight per AR server")
    p.add_argument("--ar-retries", type=int, default=d.ar_retries,
                   help="extra tries of a failed AR batch before its requests fail")
    p.add_argument("--max-attempts", type=int, default=d.max_attempts,
                   help="tries per denoise output (the first counts) before the request fails")
    p.add_argument("--outputs", choices=("fan-out", "serial"), default="fan-out",
                   help="fan-out: a request's n outputs run on n denoisers at once; serial: one after another, "
                        "as the reference deployment does (for benchmark baselines)")
    p.add_argument("--api-key", action="append", default=[],
                   help=f"require 'authorization: Bearer <key>' on GatewayService (repeatable; also ${ENV_KEYS}, "
                        "comma-separated); health and reflection stay open. Such a key may generate and call "
                        "GetStatus, not AddWorker/RemoveWorker")
    p.add_argument("--admin-key", action="append", default=[],
                   help=f"key for the admin RPCs AddWorker and RemoveWorker (repeatable; also ${ENV_ADMIN_KEYS}, "
                        "comma-separated); it may call every other RPC too. None set (the default): the admin RPCs "
                        "answer PERMISSION_DENIED to everyone")
    add_tenants_args(p)
    add_job_args(p)
    p.add_argument("--quota-store-timeout", type=float, default=REDIS_TIMEOUT_S, metavar="SECONDS",
                   help="the most one admission waits for the quota store before counting on its own (a Redis that "
                        "hangs never stalls admission)")
    p.add_argument("--quota-store", default=None, metavar="redis://HOST:PORT/N",
                   help="count the tenants' quotas in this Redis, global and exact across every gateway using it; "
                        "unset (the default): each gateway counts on its own. While it does not answer, the gateway "
                        "counts on its own (logged once; glmimage_gateway_quota_store_up 0)")
    p.add_argument("--worker-allow", action="append", default=[], type=_allow_rule, metavar="PATTERN",
                   help="addresses AddWorker may add (repeatable): a host glob with '*' within one DNS label, such "
                        "as '*.denoiser.ns.svc.cluster.local:50061', or a network for IP literals, such as "
                        "'10.0.0.0/8' or '[fd00::/8]:50061'; the port part is *, N or N-M (default *). None set "
                        "(the default): AddWorker refuses every address")
    p.add_argument("--max-workers", type=int, default=GatewayConfig.max_workers,
                   help="the most workers the pool holds, both roles and every source (--ar/--denoiser, DNS, "
                        "AddWorker) together; past it AddWorker answers FAILED_PRECONDITION and DNS additions are "
                        "logged and skipped")
    add_internal_token_args(p, "token presented as 'authorization: Bearer <token>' on every call to AR and "
                               "denoisers that require one (their --internal-token-file); of several, the first")
    p.add_argument("--ar-timeout", type=_timeout, default=None, metavar="SECONDS|auto",
                   help="seconds one AR batch call may take before its requests are retried elsewhere and its "
                        "worker is sidelined until it answers a health check; default auto: --timeout-margin times "
                        "what recent calls at that size took, plus --timeout-floor, at most --timeout-cap")
    p.add_argument("--denoise-timeout", type=_timeout, default=None, metavar="SECONDS|auto",
                   help="the same for one denoise call; auto follows the job (steps x recent step time at its size, "
                        "plus decode and encode)")
    p.add_argument("--timeout-margin", type=float, default=t.margin, help="auto timeouts: factor over recent calls")
    p.add_argument("--timeout-floor", type=float, default=t.floor, help="auto timeouts: seconds added to every one")
    p.add_argument("--timeout-cap", type=float, default=t.cap,
                   help="auto timeouts: the most a call may take (also before any call of that kind was seen)")
    p.add_argument("--health-probe-interval", type=float, default=g.health_probe_interval,
                   help="seconds between health probes of every worker (a hung process keeps its connection open: "
                        "only probes notice it)")
    p.add_argument("--health-probe-timeout", type=float, default=g.health_probe_timeout,
                   help="seconds a worker has to answer a health probe")
    p.add_argument("--health-probe-failures", type=int, default=g.health_probe_failures,
                   help="probes in a row a worker may miss before it is sidelined as hung")
    p.add_argument("--credential-recheck-interval", type=float, default=g.credential_recheck_interval,
                   help="seconds between checks of a worker that refused the gateway's internal token (a GetLimits "
                        "with it): it serves nothing until one passes")
    # Admission refuses past these, and past what no worker of a stage advertises over GetLimits (their union).
    add_limit_args(p, BOUNDS, follow_workers=True)
    p.add_argument("--queue-without-workers", action="store_true",
                   help="hold requests until their deadline when a stage has no ready worker, instead of failing "
                        "them at once with UNAVAILABLE (503)")
    return p.parse_args(argv)


def config_from(args: argparse.Namespace) -> GatewayConfig:
    width, height = args.default_size
    try:
        scheduler = SchedulerConfig(max_queued_outputs=args.max_queued_outputs,
                                    ar_batch_max_outputs=args.ar_batch_max_outputs,
                                    ar_batch_delay=args.ar_batch_delay_ms / 1000,
                                    ar_max_inflight_batches=args.ar_max_inflight_batches,
                                    ar_retries=args.ar_retries, max_attempts=args.max_attempts,
                                    serial_outputs=args.outputs == "serial",
                                    fail_fast_without_workers=not args.queue_without_workers)
    except ValueError as exc:
        raise SystemExit(f"gateway: {exc}") from None
    try:
        ar_timeout, denoise_timeout = (
            TimeoutPolicy(fixed=fixed, margin=args.timeout_margin, floor=args.timeout_floor, cap=args.timeout_cap)
            for fixed in (args.ar_timeout, args.denoise_timeout))
    except ValueError as exc:
        raise SystemExit(f"gateway: {exc}") from None
    api_keys, admin_keys = api_keys_from(args.api_key), admin_keys_from(args.admin_key)
    if args.tenants and (api_keys or admin_keys):
        raise SystemExit("gateway: --tenants names every key; give no --api-key/--admin-key (nor $GLMIMAGE_API_KEYS/"
                         "$GLMIMAGE_ADMIN_KEYS) with it: an admin is a tenant with role = \"admin\"")
    if both := set(api_keys) & set(admin_keys):
        raise SystemExit(f"gateway: {len(both)} key(s) given both as an API key and as an admin key; an admin key "
                         "must not double as a user key")
    if args.max_workers < 1:
        raise SystemExit("gateway: --max-workers must be at least 1")
    if not args.credential_recheck_interval > 0:  # 0 would probe a refusing worker in a busy loop
        raise SystemExit("gateway: --credential-recheck-interval must be more than 0")
    if len(args.ar) + len(args.denoiser) > args.max_workers:
        raise SystemExit(f"gateway: {len(args.ar) + len(args.denoiser)} workers given with --ar/--denoiser, more "
                         f"than --max-workers={args.max_workers}")
    return GatewayConfig(
        ar_addresses=tuple(args.ar), denoiser_addresses=tuple(args.denoiser), scheduler=scheduler,
        default_height=height, default_width=width, request_timeout=args.request_timeout,
        ar_timeout=ar_timeout, denoise_timeout=denoise_timeout, health_probe_timeout=args.health_probe_timeout,
        health_probe_interval=args.health_probe_interval, health_probe_failures=args.health_probe_failures,
        credential_recheck_interval=args.credential_recheck_interval,
        own_limits=tuple(own_limits(args).items()),
        ar_dns=tuple(args.ar_dns), denoiser_dns=tuple(args.denoiser_dns), dns_interval=args.dns_interval,
        client_tls=client_tls_from_args(args), api_keys=api_keys, admin_keys=admin_keys,
        worker_allow=tuple(args.worker_allow), max_workers=args.max_workers,
        worker_metadata=bearer_metadata(internal_token_from_args(args)))


# The limits the gateway's receive limit derives from (runtime.limits.max_request_bytes): it admits no
# more than it can receive, so a worker's value above the gateway's own (flag or default) does not raise them.
RECEIVE_BOUND_FIELDS = ("max_prompt_chars", "max_reference_total_bytes")


def own_limits(args: argparse.Namespace) -> dict[str, float]:
    """The gateway's ``--max-*`` flags, with the fields bounding what it receives always set."""
    own = limits_from_args(args, BOUNDS)
    for name in RECEIVE_BOUND_FIELDS:
        own.setdefault(name, getattr(Limits, name))
    return own


def tenants_from_args(args: argparse.Namespace, config: GatewayConfig) -> TenantsFile:
    """The tenants file (a bad one stops the gateway with its line and field named), else the key flags."""
    try:
        return TenantsFile(args.tenants, tenants_from_keys(config.api_keys, config.admin_keys))
    except TenantsError as exc:
        raise SystemExit(f"gateway: {exc}") from None


async def serve(args: argparse.Namespace) -> None:
    config = config_from(args)
    tenants = tenants_from_args(args, config)
    if not args.quota_store_timeout > 0:
        raise SystemExit("gateway: --quota-store-timeout must be more than 0")
    try:
        store = store_from_url(args.quota_store, args.quota_store_timeout)
    except ValueError as exc:
        raise SystemExit(f"gateway: --quota-store: {exc}") from None
    tls = server_tls_from_args(args)
    metrics = GatewayMetrics()
    if args.quota_store:
        await store.connect()  # (bounded: its own timeout) so the gauge says from the start whether it answers
        metrics.quota_store(store.up)
        store.on_state(metrics.quota_store)
    driver = Driver(config, metrics=metrics)
    auth = GatewayAuth(tenants, status_keys_from())
    gate = TenantGate(Quotas(store), metrics)
    # --jobs-db none: no jobs and no stored images here (JobService is not served; response_format url is refused).
    jobs = None if args.jobs_db == JOBS_OFF else await open_jobs(args, driver, gate, auth, tenants,
                                                                 config.default_height, config.default_width)
    servicer = GatewayServicer(driver, config, tenants, gate, auth, keeper=jobs.keeper if jobs else None)
    # Always installed: with no admin key it is what keeps AddWorker/RemoveWorker off.
    interceptors = [auth]

    def reload() -> None:
        if tenants.reload():
            metrics.tenants(tenants.current.by_name)

    # SIGHUP reloads the tenants file: calls admitted keep their tenant; later ones resolve against the new file.
    asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, reload)
    # A request is one edit's references at most (its own reference flags, else the defaults). A reply carries
    # every image of a request (10 PNGs at 2048x2048 can pass 100 MB): the same 256 MiB the REST front and the
    # Python client accept, so a big reply is not refused as RESOURCE_EXHAUSTED (a retryable 429).
    intake = intake_from_args(args, max_request_bytes(Limits(**dict(config.own_limits))))

    def add_servicers(s: grpc.aio.Server) -> None:
        gateway_service_pb2_grpc.add_GatewayServiceServicer_to_server(servicer, s)
        if jobs is not None:
            job_service_pb2_grpc.add_JobServiceServicer_to_server(jobs.servicer, s)

    names = [SERVICE_NAME, JOB_SERVICE] if jobs is not None else [SERVICE_NAME]
    server = await start_server(add_servicers, names, f"{args.host}:{args.port}",
                                interceptors=interceptors, tls=tls, intake=intake, max_send_mb=256)
    await driver.start()
    serve_metrics(args.host, args.metrics_port, args.metrics_port_file)  # before announce: see --metrics-port-file
    announce(server, args, "GatewayService")
    if args.tenants:
        log.info("tenants from %s: %s", args.tenants, ", ".join(tenants.current.by_name))
    if args.quota_store:
        log.info("quotas counted in the shared store %s", store.address)
    elif any(t.has_quotas for t in tenants.current.by_name.values()):
        log.info("quotas counted by this gateway alone (no --quota-store)")
    if config.api_keys:
        log.info("API keys required on %s (%d key(s))", SERVICE_NAME, len(config.api_keys))
    if tenants.current.has_admin:
        admin_keys = sum(len(t.digests) for t in tenants.current.by_name.values() if t.role == "admin")
        log.info("admin RPCs on (%d admin key(s)); AddWorker allows %s, up to %d workers", admin_keys,
                 ", ".join(r.text for r in config.worker_allow) or "no address", config.max_workers)
    else:
        log.info("admin RPCs off (no --admin-key)")
    if config.worker_metadata:
        log.info("presenting the internal token to workers")
    # SERVING once it knows its static workers (each answered a first health check, or failed to: at most two probe
    # timeouts), so a restarted gateway does not fail-fast its first requests; GetStatus and /health say the rest.
    await driver.first_checks(2 * config.health_probe_timeout)
    if jobs is not None:
        jobs.start()
    await server.set_serving(True)
    try:
        await run_until_signalled(server, grace=args.drain_seconds, on_drain=jobs.drain if jobs else None)
    finally:
        if jobs is not None:
            # Its jobs end within the drain grace, or go back to the store, before the driver stops under them.
            await jobs.close(grace=args.drain_seconds)
        await driver.close()
        await store.close()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    configure_logging(args.log_level)
    setup_tracing("glmimage-gateway", endpoint_from(args.otlp_endpoint))
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()
