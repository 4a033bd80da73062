"""`python -m services.launcher` (what `make run` starts): the whole suite on one machine, one process per server.

AR server, denoisers, one or more GatewayServices (each with its own queue, all over the same AR and denoisers) and
the REST front (over every gateway) each run in their own process. The launcher starts them in dependency order,
waits for each to report SERVING, prints the addresses and PIDs, restarts any that exits (on the same port, with a
backoff and a restart budget: see supervisor.RestartPolicy; SIGUSR1 retries those given up), and on Ctrl-C or
SIGTERM, and only then, stops them all. `python -m services.launcher ctl stop|start NAME` stops one server so that it
stays down, and starts it again, and `ctl restart NAME|ROLE` rolls one server, or each of a role in turn, through the
launcher's control socket (services/launcher_control.py).
Children also get SIGKILL from the kernel if the launcher itself dies, so none is orphaned. This module is the
command line and the suite's shape (which servers, with which flags, in which order); starting, health-gating and
stopping processes is services/supervisor.py.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import secrets
import signal
import socket
import sys
from pathlib import Path

from gateway.jobs.defaults import jobs_dir
from gateway.jobs.urls import ensure_secret_file
from runtime.logs import configure_logging
from runtime.tracing import add_tracing_args
from services.launcher_control import CONTROL_SOCKET, CTL_HELP, ctl, serve_control
from services.supervisor import StartupError, Supervisor

log = logging.getLogger("services.launcher")

DEFAULT_GATEWAY_PORT = 50050


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0], epilog=CTL_HELP)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--rest-port", type=int, default=8000)
    p.add_argument("--gateway-port", type=int, default=None,
                   help=f"the one gateway's port (default {DEFAULT_GATEWAY_PORT}); same as --gateway-ports PORT")
    p.add_argument("--gateway-ports", type=_port_list, default=None,
                   help="comma-separated; one gateway process per port, each over the same AR and denoisers, and "
                        "the REST front over all of them (0 = pick a free port); not with --gateway-port")
    p.add_argument("--ar-port", type=int, default=50051)
    p.add_argument("--denoiser-ports", default="50061,50062",
                   help="comma-separated; one denoiser process per port (0 = pick a free port)")
    p.add_argument("--ar-metrics-port", type=int, default=None,
                   help="the AR's Prometheus /metrics port (0 = pick a free port); off when unset")
    p.add_argument("--denoiser-metrics-ports", default=None,
                   help="comma-separated, one per --denoiser-ports entry (0 = pick a free port; denoisers beyond the "
                        "list pick one too, extra entries are unused); off when unset")
    p.add_argument("--gateway-metrics-port", type=int, default=None,
                   help="the (first) gateway's Prometheus /metrics port (0 = pick a free port); off when unset "
                        "(the REST front always serves /metrics on its own port); same as --gateway-metrics-ports "
                        "PORT")
    p.add_argument("--gateway-metrics-ports", type=_port_list, default=None,
                   help="comma-separated, one per --gateway-ports entry (0 = pick a free port; gateways beyond the "
                        "list pick one too, extra entries are unused); off when unset; not with "
                        "--gateway-metrics-port")
    p.add_argument("--model-path", default=None, help="GLM-Image checkpoint; default: the embedded tiny model")
    p.add_argument("--device", default="auto")
    p.add_argument("--torch-threads", type=int, default=1,
                   help="torch threads per model process (default 1: several processes share the cores)")
    p.add_argument("--ready-file", type=Path, default=None,
                   help="write a JSON map of role -> address here once everything is SERVING, with \"pids\" "
                        "(role -> PID, and the launcher's own), rewritten when a server is restarted")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--ar-arg", action="append", default=[],
                   help="extra flag passed to the AR, e.g. --ar-arg=--dtype=bfloat16 (repeatable)")
    p.add_argument("--denoiser-arg", action="append", default=[],
                   help="extra flag passed to every denoiser, e.g. --denoiser-arg=--default-steps=50 for real "
                        "weights (repeatable)")
    p.add_argument("--tenants", type=Path, default=None, metavar="FILE",
                   help="the tenants file (docs/operating.md#tenants), given to every gateway and the REST front; "
                        "SIGHUP to the launcher reloads it in each of them")
    p.add_argument("--quota-store", default=None, metavar="redis://HOST:PORT/N",
                   help="every gateway counts the tenants' quotas in this Redis (unset: each on its own)")
    p.add_argument("--jobs-dir", type=Path, default=None, metavar="DIR",
                   help="the stack's job store (SQLite), stored images and their secrets, kept across restarts "
                        "(default: $GLMIMAGE_JOBS_DIR, else the cache directory's jobs/)")
    p.add_argument("--jobs-db", default=None, metavar="URL",
                   help="a job store shared beyond this stack (postgresql://...) instead of the SQLite file")
    p.add_argument("--gateway-arg", action="append", default=[], help="extra flag passed to every gateway")
    p.add_argument("--rest-arg", action="append", default=[], help="extra flag passed to the REST front")
    add_tracing_args(p)
    p.add_argument("--internal-token", action="store_true",
                   help="make AR and denoisers require a random token made for this run, which the gateway "
                        "presents (through the environment, $GLMIMAGE_INTERNAL_TOKEN); off by default, so the "
                        "grpcurl calls of docs/grpcurl.md straight to the AR and denoisers work without a header")
    a = p.parse_args(argv)
    # The single-port flags stay for the callers that have them: each is the one-entry list of its plural.
    for one, several in (("gateway_port", "gateway_ports"), ("gateway_metrics_port", "gateway_metrics_ports")):
        flag, flags = f"--{one.replace('_', '-')}", f"--{several.replace('_', '-')}"
        if getattr(a, one) is not None:
            if getattr(a, several) is not None:
                p.error(f"{flag} and {flags} both given: give one ({flag} P is the same as {flags} P)")
            setattr(a, several, [getattr(a, one)])
        delattr(a, one)
    if a.gateway_ports is None:
        a.gateway_ports = [DEFAULT_GATEWAY_PORT]
    fixed = [port for port in a.gateway_ports if port]
    if len(set(fixed)) < len(fixed):
        p.error(f"--gateway-ports names a port twice: {','.join(map(str, a.gateway_ports))}")
    return a


def _port_list(text: str) -> list[int]:
    """A comma-separated list of ports (0 = pick one), for argparse."""
    try:
        ports = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of ports: {text!r}") from None
    if any(not 0 <= port < 65536 for port in ports):
        raise argparse.ArgumentTypeError(f"a port out of range in {text!r}")
    return ports


# Each port flag with the make variable that sets it, so a port in use names what to change either way.
PORT_FLAGS = {"rest_port": ("--rest-port", "REST_PORT"), "gateway_ports": ("--gateway-ports", "GATEWAY_PORTS"),
              "ar_port": ("--ar-port", "AR_PORT"), "denoiser_ports": ("--denoiser-ports", "DENOISER_PORTS"),
              "ar_metrics_port": ("--ar-metrics-port", "AR_METRICS_PORT"),
              "gateway_metrics_ports": ("--gateway-metrics-ports", "GATEWAY_METRICS_PORTS"),
              "denoiser_metrics_ports": ("--denoiser-metrics-ports", "DENOISER_METRICS_PORTS")}


def port_problem(a: argparse.Namespace) -> str | None:
    """One line naming a fixed port that is taken (or given twice) and the flag to change, else None. Checked
    before anything starts: otherwise the server that cannot bind dies with a traceback among the others' logs."""
    def ports(value: str | list[int] | int | None) -> list[int]:  # the flags come as all three (and unset)
        if value is None:
            return []
        if isinstance(value, str):
            return [int(v) for v in value.split(",")]
        return value if isinstance(value, list) else [value]

    # Only the metrics entries that a server uses (extra entries are ignored, see start_suite).
    used = {"denoiser_metrics_ports": len(a.denoiser_ports.split(",")), "gateway_metrics_ports": len(a.gateway_ports)}
    owner: dict[int, str] = {}
    for dest, (flag, var) in PORT_FLAGS.items():
        for port in ports(getattr(a, dest))[:used.get(dest)]:
            if not port:
                continue  # 0: a free one is picked
            if port in owner:
                return f"port {port} is given twice ({owner[port]} and {flag}): give each server its own"
            owner[port] = flag
            with socket.socket(socket.AF_INET6 if ":" in a.host else socket.AF_INET) as sock:
                # As the servers bind: SO_REUSEADDR, so a port left in TIME_WAIT by a stack just stopped is free.
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    sock.bind((a.host, port))
                except OSError as exc:
                    return (f"port {port} on {a.host} is not free ({exc.strerror}): stop what holds it, or change "
                            f"{flag} (make run {var}=...; 0 picks a free port)")
    return None


def gateway_names(count: int) -> list[str]:
    """The gateways' child names: plain "gateway" when there is one (as before: the banner, the ready file and
    their readers know it by that name), else gateway-1, gateway-2, ..."""
    return ["gateway"] if count == 1 else [f"gateway-{i}" for i in range(1, count + 1)]


def _metrics_port(port: int | str | None) -> int | None:
    """The port to give a server's --metrics-port (0: the server picks one and reports it back)."""
    return None if port is None else int(port)


async def start_suite(sup: Supervisor, a: argparse.Namespace) -> dict[str, str]:
    """AR and denoisers together, then the gateways on their addresses, then the REST front on the gateways'."""
    deadline = asyncio.get_running_loop().time() + a.startup_timeout
    # Every child traces to the same collector (its own $OTEL_EXPORTER_OTLP_ENDPOINT, inherited, otherwise).
    trace_flags = ["--otlp-endpoint", a.otlp_endpoint] if a.otlp_endpoint else []
    model_flags = ["--device", a.device, "--torch-threads", str(a.torch_threads), *trace_flags]
    if a.model_path:
        model_flags += ["--model-path", a.model_path]
    else:
        # Build the tiny checkpoint once, up front, rather than have every server race for the lock.
        from services.model.tiny import ensure_tiny_checkpoint

        await asyncio.to_thread(ensure_tiny_checkpoint)
    # The token goes through the environment, not argv, so `ps` does not show it.
    token_env = {"GLMIMAGE_INTERNAL_TOKEN": secrets.token_urlsafe(32)} if a.internal_token else {}
    ar = sup.child("ar", "services.ar", a.ar_port, [*model_flags, *a.ar_arg], "glmimage.v1.ArService", token_env,
                   _metrics_port(a.ar_metrics_port))
    ports = a.denoiser_ports.split(",")
    # `make run DENOISER_PORTS=a,b,c` must work with the default two metrics ports: a denoiser beyond the list
    # gets a free one (printed in the banner), and unused entries are ignored.
    metrics_ports: list[str | None] = [None] * len(ports)
    if a.denoiser_metrics_ports is not None:
        given = a.denoiser_metrics_ports.split(",")
        metrics_ports = [given[i] if i < len(given) else "0" for i in range(len(ports))]
    denoisers = [sup.child(f"denoiser-{i}", "services.denoiser", int(p), [*model_flags, *a.denoiser_arg],
                           "glmimage.v1.DenoiserService", token_env, _metrics_port(m))
                 for i, (p, m) in enumerate(zip(ports, metrics_ports, strict=True))]
    await sup.start([ar, *denoisers], deadline)

    tenant_flags = ["--tenants", str(a.tenants.resolve())] if a.tenants else []
    # With a tenants file every gateway call needs a key of it, the REST front's /health too: a key of the stack's own
    # that may call GetStatus only, through the environment (never argv).
    status_key = secrets.token_urlsafe(32) if a.tenants else None
    a.status_key = status_key  # for `ctl restart`: it asks the gateways whether a restarted worker is back
    gw_env = {**token_env, "GLMIMAGE_STATUS_KEYS": status_key} if status_key else token_env
    rest_env = {"GLMIMAGE_GATEWAY_API_KEY": status_key} if status_key else None
    store_flags = ["--quota-store", a.quota_store] if a.quota_store else []
    jobs = (a.jobs_dir or jobs_dir()).expanduser().resolve()
    # One secret for the image links, which the gateways sign and the REST front checks.
    url_secret = str(ensure_secret_file(jobs / "url-secret"))
    images = str(jobs / "images")
    # The gateways name the REST front in their image links and webhook bodies, so its port is settled before they
    # start: its socket is bound here (--rest-port 0: a free one) and handed to each REST process, so a restart of
    # the front refuses no connection (they wait in the backlog) and no other process can take the port.
    rest_listener = sup.listen(a.rest_port)
    rest_port = rest_listener.getsockname()[1]
    job_flags = ["--jobs-db", a.jobs_db or f"sqlite:///{jobs / 'jobs.sqlite3'}", "--image-store", images,
                 "--url-secret-file", url_secret, "--webhook-secret-file",
                 str(ensure_secret_file(jobs / "webhook-secret")),
                 "--public-url", f"http://{_url_host(a.host)}:{rest_port}"]
    # Every server here is supervised: a worker missing from a stage is one being restarted (a rolling restart,
    # or a crash the supervisor is mending), so the gateways hold requests for it within their deadline instead of
    # failing them at once; with one AR, `ctl restart ar` and a crashed AR then lose no request.
    gw_flags = ["--ar", ar.address, *[f"--denoiser={d.address}" for d in denoisers], "--queue-without-workers",
                *trace_flags, *tenant_flags, *store_flags, *job_flags, *a.gateway_arg]
    gw_metrics: list[int | None] = [None] * len(a.gateway_ports)
    if a.gateway_metrics_ports is not None:
        given = a.gateway_metrics_ports
        gw_metrics = [given[i] if i < len(given) else 0 for i in range(len(a.gateway_ports))]
    gateways = [sup.child(name, "gateway", port, gw_flags, "glmimage.v1.GatewayService", gw_env,
                          _metrics_port(m))
                for name, port, m in zip(gateway_names(len(a.gateway_ports)), a.gateway_ports, gw_metrics,
                                         strict=True)]
    await sup.start(gateways, deadline)

    # The REST front takes them in turn and resubmits a call that a gateway dropped unanswered to the next one.
    rest = sup.child("rest", "rest", rest_port,
                     ["--gateway-address", ",".join(g.address for g in gateways), *trace_flags, *tenant_flags,
                      "--image-store", images, "--url-secret-file", url_secret, *a.rest_arg], None, rest_env,
                     listener=rest_listener)
    await sup.start([rest], deadline)
    rest.metrics_port = rest.port  # the REST front serves /metrics on its own port
    return sup.addresses()


def _url_host(host: str) -> str:
    """The REST front's host as a link names it: a wildcard bind is reached on loopback here; IPv6 in brackets."""
    if host in ("0.0.0.0", "::", ""):
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host


def _reloads_tenants(name: str) -> bool:
    """The children that read the tenants file: the gateways and the REST front."""
    return name == "rest" or name == "gateway" or name.startswith("gateway-")


def ready_map(addresses: dict[str, str], metrics: dict[str, str], pids: dict[str, int] | None = None) -> dict:
    """What --ready-file holds: the banner's map, plus "gateways" (every gateway's address, comma-separated, as
    the REST front's --gateway-address and the SDK take them), "pids" when given and, with several gateways,
    "gateway" and "gateway-metrics" for the first one, so readers that know one gateway keep working."""
    names = [name for name in addresses if name == "gateway" or name.startswith("gateway-")]
    extra = {"gateways": ",".join(addresses[name] for name in names)}
    if names and names[0] != "gateway":
        extra["gateway"] = addresses[names[0]]
        if f"{names[0]}-metrics" in metrics:
            extra["gateway-metrics"] = metrics[f"{names[0]}-metrics"]
    if pids is not None:
        extra["pids"] = pids
    return {**addresses, **metrics, **extra}


def write_ready_file(path: Path, sup: Supervisor, control: Path | None = None) -> None:
    """Atomically: it is rewritten on each restart (a new PID) or stop (no PID), and a reader must never see half a
    file."""
    tmp = path.with_name(path.name + ".tmp")
    ready = ready_map(sup.addresses(), sup.metrics_urls(), {"launcher": os.getpid(), **sup.pids()})
    if control is not None:
        ready["control"] = str(control)
    tmp.write_text(json.dumps(ready))
    tmp.replace(path)


async def run(args: argparse.Namespace) -> int:
    problem = port_problem(args)
    if problem:
        print(f"launcher: error: {problem}", file=sys.stderr)
        return 1
    sup = Supervisor(args.host, args.log_level)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    # The way back for a server given up on, short of restarting the stack. Not SIGHUP: a closed terminal sends it.
    loop.add_signal_handler(signal.SIGUSR1, sup.retry_given_up)
    if args.tenants:  # (only then: without a file to reload, SIGHUP keeps its default, as from a closed terminal)
        loop.add_signal_handler(signal.SIGHUP, lambda: sup.send(signal.SIGHUP, _reloads_tenants))
    code = 0
    try:
        starting = asyncio.ensure_future(start_suite(sup, args))
        stopping = asyncio.ensure_future(stop.wait())
        await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():
            starting.cancel()
            return 130
        stopping.cancel()
        addresses = starting.result()
        rest = addresses["rest"]
        lines = [f"  {name:<12} {addr}" for name, addr in addresses.items()]
        # After the address lines, which stay as they were (tools parse them): one line per /metrics endpoint.
        metrics = sup.metrics_urls()
        lines += [f"  {name:<20} {url}" for name, url in metrics.items()]
        control = await serve_control(sup, getattr(args, "status_key", None))
        control_path = sup.run_dir / CONTROL_SOCKET if control is not None else None
        if args.ready_file:
            write_ready_file(args.ready_file, sup, control_path)
            sup.on_restart = lambda: write_ready_file(args.ready_file, sup, control_path)
        pids = ", ".join(f"{name} {pid}" for name, pid in {"launcher": os.getpid(), **sup.pids()}.items())
        print("GLM-Image stack is up:\n" + "\n".join(lines) + f"\n\n  pids: {pids}" +
              f"\n  try: curl -s http://{rest}/v1/images/generations -H 'Content-Type: application/json' "
              "-d '{\"prompt\":\"a red \\\"STOP\\\" sign\",\"n\":1,\"size\":\"256x256\"}'\n"
              f"  Ctrl-C stops everything; kill -USR1 {os.getpid()} restarts any server given up on; "
              "python -m services.launcher ctl stop|start NAME stops one server, or starts it again; ctl restart "
              "NAME|ROLE rolls one, or each of a role in turn.", flush=True)
        # From here on a child that exits is restarted (or given up, loudly): only a signal stops the stack.
        supervising = asyncio.ensure_future(sup.supervise())
        stopping = asyncio.ensure_future(stop.wait())
        await asyncio.wait({supervising, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if supervising.done():
            supervising.result()  # it returns only by raising: a bug in the supervisor surfaces here
        # Cancelled before `stop`, so no restart races the shutdown.
        if control is not None:
            control.close()
        supervising.cancel()
        await asyncio.gather(supervising, return_exceptions=True)
    except StartupError as exc:
        log.error("%s", exc)
        code = 1
    finally:
        log.info("stopping the stack")
        await sup.stop()
    return code


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["ctl"]:  # a client of a running launcher, not a stack
        sys.exit(ctl(argv[1:]))
    args = parse_args(argv)
    configure_logging(args.log_level)
    sys.exit(asyncio.run(run(args)))


if __name__ == "__main__":
    main()
