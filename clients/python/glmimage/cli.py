"""`glmimage`: generate images and inspect a GLM-Image gateway from the command line.

    glmimage generate "a red STOP sign" -n 2 --size 512x512 -o out/
    glmimage generate "a red STOP sign" --stream --partial-images 2 -o out/
    glmimage edit photo.png -p "make the sign blue" --size 512x512 -o out/
    glmimage generate "a red STOP sign" --lora tiny-style:0.8 -o out/
    glmimage generate "a red STOP sign" --priority batch -o out/
    glmimage status
    glmimage loras list
    glmimage jobs submit "a red STOP sign" -n 4 --size 1024x1024 --wait -o out/
    glmimage jobs list

Printing is this module's interface; errors go to stderr with a non-zero exit code.
"""
from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TextIO

import grpc

from glmimage.cli_common import (
    extension,
    print_usage,
    refuse_to_overwrite,
    request_args,
    request_kwargs,
    table,
)
from glmimage.cli_jobs import add_jobs_parser, run_jobs
from glmimage.client import (
    DEFAULT_ADDRESS,
    NO_RETRY,
    Client,
    Completed,
    GenerationResult,
    GlmImageError,
    Limits,
    LoraCatalogue,
    LoraPlacement,
    PartialImage,
    Progress,
    RateLimits,
    RetryPolicy,
    Status,
    TlsConfig,
    WorkerInfo,
)

API_KEY_ENV = "GLMIMAGE_API_KEY"
ADDRESS_ENV = "GLMIMAGE_ADDRESS"


def _connection_args(parser: argparse.ArgumentParser, *, suppress: bool = False) -> None:
    """The connection flags (and --json, -v), accepted before the subcommand and after it.

    The top-level copy carries the defaults; the subcommands' copies default to SUPPRESS, so they set a value only
    when given: a flag after the subcommand wins over the same flag before it.
    """
    def default(value: object) -> object:
        return argparse.SUPPRESS if suppress else value

    g = parser.add_argument_group("connection (before or after the subcommand)")
    g.add_argument("--address", default=default(os.environ.get(ADDRESS_ENV, DEFAULT_ADDRESS)),
                   help=f"GatewayService host:port, several comma-separated IP:port, or dns:///name:port; "
                   f"several are called round robin (default {DEFAULT_ADDRESS}, or ${ADDRESS_ENV})")
    g.add_argument("--api-key", default=default(os.environ.get(API_KEY_ENV)),
                   help=f"sent as 'authorization: Bearer <key>' (default ${API_KEY_ENV})")
    # Each default is written into its help: the subcommands' copies have none for argparse to show.
    g.add_argument("--timeout", type=float, default=default(600.0),
                   help="overall deadline in seconds, retries included; for jobs wait (and submit --wait), how long "
                   "to wait (default 600)")
    g.add_argument("--retries", type=int, default=default(3),
                   help="retries on UNAVAILABLE / RESOURCE_EXHAUSTED, with exponential backoff (default 3; 0 "
                   "disables)")
    g.add_argument("--tls", action="store_true", default=default(False), help="use TLS with the system trust store")
    g.add_argument("--tls-ca", type=Path, metavar="PEM", default=default(None),
                   help="CA bundle that signed the server certificate (implies --tls)")
    g.add_argument("--tls-cert", type=Path, metavar="PEM", default=default(None),
                   help="client certificate for mutual TLS")
    g.add_argument("--tls-key", type=Path, metavar="PEM", default=default(None),
                   help="client private key for mutual TLS")
    g.add_argument("--tls-server-name", default=default(None),
                   help="expected server name, when it differs from the address host")
    g.add_argument("-v", "--verbose", action="store_true", default=default(False),
                   help="log retries and connection details to stderr")
    g.add_argument("--json", action="store_true", default=default(False),
                   help="print the result as JSON (generate, edit: files, seeds and usage; jobs: the job)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="glmimage", description="GLM-Image gateway client")
    _connection_args(parser)
    conn = argparse.ArgumentParser(add_help=False)
    _connection_args(conn, suppress=True)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", parents=[conn], help="generate images and write them to a directory")
    gen.add_argument("prompt")
    _image_args(gen)
    edit = sub.add_parser("edit", parents=[conn], help="edit images (the references) and write the outputs")
    edit.add_argument("images", nargs="+", type=Path, metavar="IMAGE",
                      help="reference image files (PNG, JPEG or WebP), sent as they are")
    edit.add_argument("-p", "--prompt", required=True, help="what to make of the references")
    _image_args(edit)

    sub.add_parser("status", parents=[conn], help="show the gateway's queues and workers")
    sub.add_parser("limits", parents=[conn], help="show the limits in force (what the gateway refuses past)")

    loras = sub.add_parser("loras", help="the LoRA adapters requests may name; load or unload them (admin role)")
    loras_sub = loras.add_subparsers(dest="loras_command", required=True)
    loras_sub.add_parser("list", parents=[conn],
                         help="the adapters, and which denoiser holds which loaded (admin role)")
    for verb, what in (("load", "load adapters on denoisers ahead of the requests that name them"),
                       ("unload", "drop adapters from the denoisers' memory (the files stay)")):
        p = loras_sub.add_parser(verb, parents=[conn], help=f"admin role: {what}")
        p.add_argument("names", nargs="+", metavar="NAME", help="adapter names, as `glmimage loras list` shows them")
        p.add_argument("--worker", action="append", default=[], metavar="ADDR",
                       help="a denoiser's address, repeatable (default: every denoiser of the pool)")
    add_jobs_parser(sub, conn)
    return parser


def _image_args(parser: argparse.ArgumentParser) -> None:
    """The output and request flags that generate and edit share."""
    parser.add_argument("-o", "--output-dir", type=Path, default=Path("."),
                        help="directory for the images (default: the current one)")
    parser.add_argument("--name", default="image", help="file name stem: <name>-<i>.<ext> (default: image)")
    parser.add_argument("--force", action="store_true",
                        help="overwrite files of those names; without it an existing file is an error, before "
                        "anything is generated")
    request_args(parser)
    parser.add_argument("--stream", action="store_true", help="stream progress (a progress bar on stderr)")
    parser.add_argument("--partial-images", type=int, default=0, choices=range(4), metavar="{0-3}",
                        help="with --stream: previews per image, written as <name>-<i>.partial-<k>.<ext> "
                        "(default 0)")


def client_from(args: argparse.Namespace) -> Client:
    tls = None
    if args.tls or args.tls_ca or args.tls_cert or args.tls_key:
        tls = TlsConfig.from_files(args.tls_ca, args.tls_cert, args.tls_key, args.tls_server_name)
    retry = NO_RETRY if args.retries <= 0 else RetryPolicy(max_attempts=args.retries + 1)
    return Client(args.address, api_key=args.api_key, tls=tls, timeout=args.timeout, retry=retry,
                  base_url=getattr(args, "base_url", None))


class ProgressBar:
    """One-line progress over all images, redrawn with carriage returns; no terminal library needed."""

    def __init__(self, n: int, out: TextIO, width: int = 30) -> None:
        self.steps: dict[int, tuple[int, int]] = {}
        self.n = n
        self.out = out
        self.width = width

    def update(self, event: Progress) -> None:
        self.steps[event.image_index] = (event.step, event.total_steps)
        done = sum(s for s, _ in self.steps.values())
        # Images that have not reported yet are assumed to need as many steps as those that have.
        per_image = max(t for _, t in self.steps.values())
        total = sum(t for _, t in self.steps.values()) + per_image * (self.n - len(self.steps))
        frac = done / total if total else 0.0
        filled = int(round(frac * self.width))
        bar = "#" * filled + "-" * (self.width - filled)
        self.out.write(f"\r[{bar}] {frac:4.0%}  {done}/{total} steps")
        self.out.flush()

    def finish(self) -> None:
        if self.steps:
            self.out.write("\n")
            self.out.flush()


def _generate(args: argparse.Namespace, client: Client) -> int:
    """generate and edit: the same flags, files and output; an edit also sends its reference images."""
    if args.command == "edit":
        run, stream = functools.partial(client.edit, args.images), functools.partial(client.edit_stream, args.images)
    else:
        run, stream = client.generate, client.generate_stream
    kwargs = request_kwargs(args)
    ext = extension(args)
    planned = [args.output_dir / f"{args.name}-{i}.{ext}" for i in range(args.n)]
    if args.stream:
        planned += [_partial_path(args, i, k, ext) for i in range(args.n) for k in range(args.partial_images)]
    refuse_to_overwrite(planned, args.force)
    partial_paths: list[Path] = []
    if args.stream:
        bar = ProgressBar(args.n, sys.stderr)
        result: GenerationResult | None = None
        try:
            for event in stream(args.prompt, partial_images=args.partial_images, **kwargs):
                if isinstance(event, Progress):
                    bar.update(event)
                elif isinstance(event, PartialImage):
                    args.output_dir.mkdir(parents=True, exist_ok=True)
                    path = _partial_path(args, event.image_index, event.partial_image_index, ext)
                    with open(path, "wb" if args.force else "xb") as f:
                        f.write(event.image)
                    partial_paths.append(path)
                elif isinstance(event, Completed):
                    result = event.result
        finally:
            bar.finish()
        if result is None:  # generate_stream raises first; kept so a broken server cannot crash the CLI
            raise ValueError("the stream ended without a result")
    else:
        result = run(args.prompt, **kwargs)
    paths = result.save(args.output_dir, args.name, overwrite=args.force)
    if args.json:
        print(json.dumps({"files": [str(p) for p in paths], "partial_files": [str(p) for p in partial_paths],
                          "seeds": result.seeds, "width": result.width, "height": result.height,
                          "output_format": result.output_format, "request_id": result.request_id,
                          "usage": result.usage.as_dict(),
                          "rate_limits": None if result.rate_limits.empty else asdict(result.rate_limits)},
                         indent=2))
        return 0
    for path, seed in zip(paths, result.seeds, strict=True):
        print(f"wrote {path}  ({result.width}x{result.height}, seed {seed})")
    for path in partial_paths:
        print(f"wrote {path}  (partial)")
    print_usage(result.usage, len(paths))
    limits = format_rate_limits(result.rate_limits)
    if limits:
        print(limits)
    return 0


def format_rate_limits(limits: RateLimits) -> str | None:
    """One line for the quotas the gateway reported ("rate limits: 29/30 requests left, resets in 59s; ..."), or
    None when it reported none. The resets are shown as the gateway wrote them."""
    parts = []
    for kind in ("requests", "images"):
        limit, remaining = getattr(limits, f"limit_{kind}"), getattr(limits, f"remaining_{kind}")
        reset = getattr(limits, f"reset_{kind}_raw")
        if limit is None and remaining is None:
            continue
        part = f"{'?' if remaining is None else remaining}/{'?' if limit is None else limit} {kind} left"
        parts.append(part if reset is None else f"{part}, resets in {reset}")
    return f"rate limits: {'; '.join(parts)}" if parts else None


def _partial_path(args: argparse.Namespace, image: int, partial: int, ext: str) -> Path:
    return args.output_dir / f"{args.name}-{image}.partial-{partial}.{ext}"


def format_status(status: Status) -> str:
    """The queues, then one row per worker (a denoiser's loaded LoRA adapters last), as aligned plain-text
    tables."""
    queues = [("pending AR requests", status.pending_ar_requests), ("pending AR outputs", status.pending_ar_outputs),
              ("pending denoise outputs", status.pending_denoise_outputs), ("active requests", status.active_requests)]
    lines = [table(["QUEUE", "DEPTH"], [[name, str(v)] for name, v in queues]), ""]
    # Without the admin role the gateway shows no addresses and only the caller's own jobs: workers by position.
    rows = [[w.role, w.address or f"#{i}", w.state, str(w.inflight), _job(w), ",".join(w.loras_loaded) or "-"]
            for i, w in enumerate(status.workers)]
    lines.append(table(["ROLE", "ADDRESS", "STATE", "INFLIGHT", "JOB", "LORAS"], rows) if rows else "no workers")
    if status.tenants:  # every tenant to the admin role, else the caller's own
        lines += ["", table(["TENANT", "WEIGHT", "QUEUED AR", "QUEUED DENOISE", "ACTIVE", "IMAGES", "OLDEST WAIT",
                              "REQUESTS LEFT", "IMAGES LEFT"], [[
            t.name, f"{t.weight:g}", str(t.pending_ar_requests), str(t.pending_denoise_outputs), str(t.active_requests),
            f"{t.inflight_images}" + (f"/{t.max_inflight_images}" if t.max_inflight_images else ""),
            f"{t.oldest_wait_seconds:.1f}s",
            f"{t.remaining_requests}/{t.requests_per_minute}" if t.requests_per_minute else "-",
            f"{t.remaining_images}/{t.images_per_minute}" if t.images_per_minute else "-"] for t in status.tenants])]
    return "\n".join(lines)


def _job(w: WorkerInfo) -> str:
    """A denoiser's job: its id, or whose it is when the gateway does not show the id (AR batches have none)."""
    if w.current_job:
        return w.current_job
    if w.held_elsewhere:
        return "(another gateway's)"
    return "(another caller's)" if w.role == "denoiser" and w.inflight else "-"


def _status(args: argparse.Namespace, client: Client) -> int:
    status = client.status()
    if args.json:
        print(json.dumps({"pending_ar_requests": status.pending_ar_requests,
                          "pending_ar_outputs": status.pending_ar_outputs,
                          "pending_denoise_outputs": status.pending_denoise_outputs,
                          "active_requests": status.active_requests,
                          "workers": [asdict(w) for w in status.workers],
                          "tenants": [asdict(t) for t in status.tenants]}, indent=2))
    else:
        print(format_status(status))
    return 0


def format_limits(limits: Limits) -> str:
    """One row per limit; integers in full (a byte count as 8388608, not 8.38861e+06)."""
    def number(value: float) -> str:
        if isinstance(value, bool):  # a capability (step_cache), not a bound
            return "yes" if value else "no"
        return str(int(value)) if float(value).is_integer() else f"{value:g}"

    return table(["LIMIT", "VALUE"], [[name, number(value)] for name, value in asdict(limits).items()])


def _limits(args: argparse.Namespace, client: Client) -> int:
    limits = client.limits()
    print(json.dumps(asdict(limits), indent=2) if args.json else format_limits(limits))
    return 0


def format_loras(catalogue: LoraCatalogue) -> str:
    """The adapters, then (admin role) what each denoiser holds loaded."""
    rows = [[info.name, f"{info.default_scale:g}", str(info.size_bytes), info.description]
            for info in catalogue.loras]
    lines = [table(["NAME", "DEFAULT_SCALE", "BYTES", "DESCRIPTION"], rows) if rows else "no adapters"]
    if catalogue.placement:
        lines += ["", format_placement(catalogue.placement)]
    return "\n".join(lines)


def format_placement(placement: list[LoraPlacement]) -> str:
    rows = [[p.worker, ",".join(p.loaded) or "-", p.error or "-"] for p in placement]
    return table(["WORKER", "LOADED", "ERROR"], rows) if rows else "no denoisers"


def _loras(args: argparse.Namespace, client: Client) -> int:
    """loras list / load / unload. A load or unload that some denoiser could not do exits 1, after the table."""
    if args.loras_command == "list":
        catalogue = client.list_loras()
        print(json.dumps(asdict(catalogue), indent=2) if args.json else format_loras(catalogue))
        return 0
    call = client.load_loras if args.loras_command == "load" else client.unload_loras
    placement = call(args.names, args.worker)
    print(json.dumps([asdict(p) for p in placement], indent=2) if args.json else format_placement(placement))
    for p in placement:
        if p.error:
            print(f"glmimage: error: {p.worker}: {p.error}", file=sys.stderr)
    return 1 if any(p.error for p in placement) else 0


def _print_refusal(exc: GlmImageError) -> None:
    """What a quota refusal adds: which quota, when to come back, and the tenant's limits as they stood."""
    if exc.quota:
        wait = f"; retry after {exc.retry_after:g}s" if exc.retry_after is not None else ""
        print(f"glmimage: quota {exc.quota} reached{wait}", file=sys.stderr)
    limits = format_rate_limits(exc.rate_limits)
    if limits:
        print(f"glmimage: {limits}", file=sys.stderr)


# --- jobs ----------------------------------------------------------------------------------------------------------


COMMANDS = {"generate": _generate, "edit": _generate, "status": _status, "limits": _limits, "loras": _loras,
            "jobs": run_jobs}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        with client_from(args) as client:
            return COMMANDS[args.command](args, client)
    except GlmImageError as exc:
        if args.command == "jobs" and exc.code == grpc.StatusCode.NOT_FOUND and getattr(args, "id", None):
            # Another tenant's job answers as one that never existed: the message cannot tell them apart either.
            print(f"glmimage: error: no such job (or not yours): {args.id}", file=sys.stderr)
            return 1
        print(f"glmimage: error: {exc.code.name}: {exc.details}", file=sys.stderr)
        _print_refusal(exc)
        return 1
    except (OSError, ValueError) as exc:
        print(f"glmimage: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
