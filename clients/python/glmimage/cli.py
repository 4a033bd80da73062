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
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TextIO

import grpc

from glmimage.client import (
    DEFAULT_ADDRESS,
    FORMATS,
    NO_RETRY,
    Client,
    Completed,
    GenerationResult,
    GlmImageError,
    Job,
    Limits,
    LoraCatalogue,
    LoraPlacement,
    PartialImage,
    Progress,
    RateLimits,
    RetryPolicy,
    Status,
    TlsConfig,
    Usage,
    WorkerInfo,
)
from glmimage.jobs import JOB_STATUSES
from glmimage.messages import PRIORITIES, STEP_CACHE_LEVELS, Lora
from glmimage.wire.sizes import size_arg

API_KEY_ENV = "GLMIMAGE_API_KEY"
ADDRESS_ENV = "GLMIMAGE_ADDRESS"
BASE_URL_ENV = "GLMIMAGE_BASE_URL"


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
    _jobs_parser(sub, conn)
    return parser


def _jobs_parser(sub: argparse._SubParsersAction, conn: argparse.ArgumentParser) -> None:
    jobs = sub.add_parser("jobs", help="generations that outlive the connection: submit, follow, cancel, list")
    jobs_sub = jobs.add_subparsers(dest="jobs_command", required=True)
    submit = jobs_sub.add_parser("submit", parents=[conn],
                                 help="submit a generation (an edit with --image) as a job; prints its id")
    submit.add_argument("prompt")
    _request_args(submit)
    submit.add_argument("--image", action="append", type=Path, default=[], metavar="FILE",
                        help="a reference image (PNG, JPEG or WebP), repeatable: the job is an edit")
    submit.add_argument("--webhook-url", default=None, metavar="URL",
                        help="https URL the job is POSTed to when it ends, signed (the gateway's --webhook-allow "
                        "must admit it)")
    submit.add_argument("--idempotency-key", default=None, metavar="KEY",
                        help="a second submit with the same key answers the first's job (default: a fresh key per "
                        "run, so the CLI's own retries never make a second job)")
    submit.add_argument("--wait", action="store_true",
                        help="follow the job to its end (progress on stderr), as `jobs wait` does")
    _job_output_args(submit)
    for verb, what in (("get", "show a job as it is now"), ("cancel", "cancel a job (a running one frees its "
                                                                      "denoisers); shows it after the call")):
        p = jobs_sub.add_parser(verb, parents=[conn], help=what)
        p.add_argument("id", metavar="ID", help="the job's id (job_...)")
        if verb == "get":
            _base_url_arg(p)
    wait = jobs_sub.add_parser("wait", parents=[conn],
                               help="follow a job to its end, progress on stderr (--timeout bounds the wait; the "
                               "job goes on after it)")
    wait.add_argument("id", metavar="ID", help="the job's id (job_...)")
    _job_output_args(wait)
    lst = jobs_sub.add_parser("list", parents=[conn], help="this key's jobs, newest first")
    lst.add_argument("--limit", type=int, default=20, help="jobs per page, 1-100 (default 20)")
    lst.add_argument("--after", default=None, metavar="ID", help="the page after this job (the last one shown)")
    lst.add_argument("--status", choices=JOB_STATUSES, default=None, help="only jobs in this status")
    lst.add_argument("--all", action="store_true", help="every page, not only the first")


def _job_output_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-o", "--out", "--output-dir", dest="output_dir", type=Path, default=None, metavar="DIR",
                        help="write a completed job's images here (implies --wait for submit; default: print their "
                        "URLs)")
    parser.add_argument("--name", default="image", help="file name stem: <name>-<i>.<ext> (default: image)")
    parser.add_argument("--force", action="store_true",
                        help="overwrite files of those names; without it an existing file is an error")
    _base_url_arg(parser)


def _base_url_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default=os.environ.get(BASE_URL_ENV), metavar="URL",
                        help="the REST front's base URL (e.g. http://127.0.0.1:8000): image URLs a gateway without "
                        f"--public-url gives as paths are shown against it (default ${BASE_URL_ENV})")


def lora_arg(text: str) -> Lora:
    """argparse type of --lora: a bad value is a usage error (exit 2) naming the flag."""
    try:
        return Lora.parse(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME[:SCALE], SCALE a finite number "
                                         "(e.g. tiny-style or tiny-style:0.8)") from None


def _image_args(parser: argparse.ArgumentParser) -> None:
    """The output and request flags that generate and edit share."""
    parser.add_argument("-o", "--output-dir", type=Path, default=Path("."),
                        help="directory for the images (default: the current one)")
    parser.add_argument("--name", default="image", help="file name stem: <name>-<i>.<ext> (default: image)")
    parser.add_argument("--force", action="store_true",
                        help="overwrite files of those names; without it an existing file is an error, before "
                        "anything is generated")
    _request_args(parser)
    parser.add_argument("--stream", action="store_true", help="stream progress (a progress bar on stderr)")
    parser.add_argument("--partial-images", type=int, default=0, choices=range(4), metavar="{0-3}",
                        help="with --stream: previews per image, written as <name>-<i>.partial-<k>.<ext> "
                        "(default 0)")


def _request_args(parser: argparse.ArgumentParser) -> None:
    """The request flags of generate, edit and jobs submit."""
    parser.add_argument("-n", type=int, default=1, help="number of images, 1-10 (default 1)")
    parser.add_argument("--size", type=size_arg, default=None, metavar="WxH",
                        help="e.g. 512x512 (default: the gateway's)")
    parser.add_argument("--format", choices=sorted(FORMATS), default=None, help="image encoding (default png)")
    parser.add_argument("--compression", type=int, default=None,
                        help="0-100, 100 the least compressed (default: the gateway's)")
    parser.add_argument("--seed", type=int, default=None,
                        help="output i uses seed + i (default: the gateway picks one)")
    parser.add_argument("--steps", type=int, default=None, help="denoising steps (default: the gateway's)")
    parser.add_argument("--guidance", type=float, default=None, help="guidance scale (default: the gateway's)")
    parser.add_argument("--step-cache", choices=STEP_CACHE_LEVELS, default=None,
                        help="denoising steps extrapolated instead of computed: faster, further from the uncached "
                        "image (default off)")
    parser.add_argument("--lora", type=lora_arg, action="append", default=[], metavar="NAME[:SCALE]",
                        help="a LoRA adapter the denoiser runs with, repeatable; SCALE -4 to 4, 0 off (default: "
                        "none; without SCALE the adapter's own default; `glmimage loras list` names them)")
    parser.add_argument("--priority", choices=PRIORITIES, default=None,
                        help="the request's class within its tenant's share, up to the key's max_priority; batch "
                        "runs only on otherwise idle capacity (default: default)")


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
    kwargs = _request_kwargs(args)
    ext = _extension(args)
    planned = [args.output_dir / f"{args.name}-{i}.{ext}" for i in range(args.n)]
    if args.stream:
        planned += [_partial_path(args, i, k, ext) for i in range(args.n) for k in range(args.partial_images)]
    _refuse_to_overwrite(planned, args.force)
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
    _print_usage(result.usage, len(paths))
    limits = format_rate_limits(result.rate_limits)
    if limits:
        print(limits)
    return 0


def _request_kwargs(args: argparse.Namespace) -> dict[str, object]:
    return dict(n=args.n, size=args.size, output_format=args.format, output_compression=args.compression,
                seed=args.seed, steps=args.steps, guidance=args.guidance, step_cache=args.step_cache,
                loras=args.lora, priority=args.priority)


def _extension(args: argparse.Namespace) -> str:
    return {"jpeg": "jpg"}.get(args.format or "png", args.format or "png")


def _print_usage(usage: Usage, images: int) -> None:
    print(f"usage: prompt_tokens={usage.prompt_tokens} completion_tokens={usage.completion_tokens} "
          f"total_tokens={usage.total_tokens} cached_tokens={usage.cached_tokens} image_tokens={usage.image_tokens} "
          f"images={images}")


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


def _refuse_to_overwrite(paths: list[Path], force: bool) -> None:
    """Checked before the request, so an earlier run's images are neither lost nor paid for again. (The writes
    themselves refuse too, for a file that appears meanwhile.)"""
    existing = [p for p in paths if p.exists()]
    if existing and not force:
        more = f" (and {len(existing) - 1} more)" if len(existing) > 1 else ""
        raise FileExistsError(f"{existing[0]} exists{more}; --force overwrites, or choose another -o or --name")


def format_status(status: Status) -> str:
    """The queues, then one row per worker (a denoiser's loaded LoRA adapters last), as aligned plain-text
    tables."""
    queues = [("pending AR requests", status.pending_ar_requests), ("pending AR outputs", status.pending_ar_outputs),
              ("pending denoise outputs", status.pending_denoise_outputs), ("active requests", status.active_requests)]
    lines = [_table(["QUEUE", "DEPTH"], [[name, str(v)] for name, v in queues]), ""]
    # Without the admin role the gateway shows no addresses and only the caller's own jobs: workers by position.
    rows = [[w.role, w.address or f"#{i}", w.state, str(w.inflight), _job(w), ",".join(w.loras_loaded) or "-"]
            for i, w in enumerate(status.workers)]
    lines.append(_table(["ROLE", "ADDRESS", "STATE", "INFLIGHT", "JOB", "LORAS"], rows) if rows else "no workers")
    if status.tenants:  # every tenant to the admin role, else the caller's own
        lines += ["", _table(["TENANT", "WEIGHT", "QUEUED AR", "QUEUED DENOISE", "ACTIVE", "IMAGES", "OLDEST WAIT",
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


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
                     for row in [header, *rows])


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

    return _table(["LIMIT", "VALUE"], [[name, number(value)] for name, value in asdict(limits).items()])


def _limits(args: argparse.Namespace, client: Client) -> int:
    limits = client.limits()
    print(json.dumps(asdict(limits), indent=2) if args.json else format_limits(limits))
    return 0


def format_loras(catalogue: LoraCatalogue) -> str:
    """The adapters, then (admin role) what each denoiser holds loaded."""
    rows = [[info.name, f"{info.default_scale:g}", str(info.size_bytes), info.description]
            for info in catalogue.loras]
    lines = [_table(["NAME", "DEFAULT_SCALE", "BYTES", "DESCRIPTION"], rows) if rows else "no adapters"]
    if catalogue.placement:
        lines += ["", format_placement(catalogue.placement)]
    return "\n".join(lines)


def format_placement(placement: list[LoraPlacement]) -> str:
    rows = [[p.worker, ",".join(p.loaded) or "-", p.error or "-"] for p in placement]
    return _table(["WORKER", "LOADED", "ERROR"], rows) if rows else "no denoisers"


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


def _when(ts: int | None) -> str:
    """Unix seconds as UTC ISO 8601 ("-" for not yet): the same text on every machine."""
    return "-" if ts is None else time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))


def job_progress(job: Job) -> str:
    """The PROGRESS column: where a queued job waits, a running one's steps, an ended one's outcome."""
    p = job.progress
    if job.status == "queued":
        return f"queue {p.queue_position}" if p.queue_position else "queued"
    if job.status == "in_progress":
        return f"{p.step}/{p.total_steps} steps" if p.total_steps else "starting"
    if job.status == "completed":
        return f"{len(job.images)} image{'s' if len(job.images) != 1 else ''}"
    if job.status == "failed" and job.error is not None:
        return job.error.code
    return "-"


def format_jobs(jobs: Sequence[Job]) -> str:
    rows = [[j.id, j.status, _when(j.created_at), job_progress(j)] for j in jobs]
    return _table(["ID", "STATUS", "CREATED", "PROGRESS"], rows) if rows else "no jobs"


def _urls(job: Job) -> list[str]:
    """The images' URLs, absolute when they are or a base URL is known; as the gateway gave them otherwise."""
    try:
        return job.image_urls()
    except ValueError:
        return [im.url for im in job.images]


def format_job(job: Job) -> str:
    """One job, a field a line; a completed job's images by URL (signed links that expire)."""
    fields = [("id", job.id), ("status", job.status), ("progress", job_progress(job)),
              ("created", _when(job.created_at)), ("started", _when(job.started_at)),
              ("finished", _when(job.finished_at)), ("expires", _when(job.expires_at)),
              ("attempts", str(job.attempts)), ("images asked", str(job.n)), ("edit", "yes" if job.edit else "no"),
              ("request id", job.request_id or "-"), ("webhook", job.webhook_url or "-")]
    if job.error is not None:
        fields.append(("error", str(job.error)))
    if job.ok:
        fields.append(("size", f"{job.width}x{job.height} {job.output_format}"))
    fields += [(f"image {im.index}", f"{url}  (seed {im.seed})") for im, url in zip(job.images, _urls(job),
                                                                                      strict=True)]
    width = max(len(name) for name, _ in fields)
    return "\n".join(f"{name.ljust(width)}  {value}" for name, value in fields)


class JobProgressLine:
    """One line on stderr redrawn at each update: the queue position, then a bar over the job's steps."""

    def __init__(self, out: TextIO, width: int = 30) -> None:
        self.out = out
        self.width = width
        self.drawn = 0

    def update(self, job: Job) -> None:
        p = job.progress
        if job.status == "in_progress" and p.total_steps:
            frac = p.step / p.total_steps
            filled = int(round(frac * self.width))
            text = f"[{'#' * filled}{'-' * (self.width - filled)}] {frac:4.0%}  {p.step}/{p.total_steps} steps"
        else:
            text = f"{job.id} {job.status}" + (f", queue position {p.queue_position}"
                                               if job.status == "queued" and p.queue_position else "")
        # Padded over the previous text, so a shorter line leaves nothing of a longer one.
        self.out.write("\r" + text.ljust(self.drawn))
        self.out.flush()
        self.drawn = len(text)

    def finish(self) -> None:
        if self.drawn:
            self.out.write("\n")
            self.out.flush()


def _job_files(args: argparse.Namespace, n: int, ext: str) -> list[Path]:
    return [args.output_dir / f"{args.name}-{i}.{ext}" for i in range(n)]


def _follow(client: Client, job: Job | str) -> Job:
    """The job followed to its end, its progress drawn on stderr; --timeout bounds the wait."""
    line = JobProgressLine(sys.stderr)
    if isinstance(job, Job):
        line.update(job)  # wait calls back only on changes: the state known already is drawn now
    try:
        return client.wait(job, on_update=line.update)
    finally:
        line.finish()


def _report_end(args: argparse.Namespace, client: Client, job: Job) -> int:
    """An ended job: a completed one's images written (-o) or listed by URL; a failed or cancelled one exits 1."""
    paths: list[Path] = []
    if job.ok and args.output_dir is not None:
        _refuse_to_overwrite(_job_files(args, len(job.images), job.extension), args.force)
        # The bytes over gRPC (GetJob include_images): the same key and channel, no REST front to reach.
        full = client.get_job(job.id, include_images=True)
        paths = full.download(args.output_dir, args.name, overwrite=args.force)
    if args.json:
        print(json.dumps({**job.as_dict(), "files": [str(p) for p in paths]}, indent=2))
    elif job.ok:
        print(f"{job.id} completed")
        if paths:
            for path, seed in zip(paths, job.seeds, strict=True):
                print(f"wrote {path}  ({job.width}x{job.height}, seed {seed})")
        else:
            for im, url in zip(job.images, _urls(job), strict=True):
                print(f"image {im.index}: {url}  (seed {im.seed})")
        if job.usage is not None:
            _print_usage(job.usage, len(job.images))
    if job.status == "failed":
        print(f"glmimage: error: job {job.id} failed: {job.error or 'no reason given'}", file=sys.stderr)
        return 1
    if job.status == "cancelled":
        print(f"glmimage: error: job {job.id} was cancelled", file=sys.stderr)
        return 1
    return 0


def _jobs_submit(args: argparse.Namespace, client: Client) -> int:
    waiting = args.wait or args.output_dir is not None
    if args.output_dir is not None:
        _refuse_to_overwrite(_job_files(args, args.n, _extension(args)), args.force)
    job = client.submit_job(args.prompt, images=args.image or None, webhook_url=args.webhook_url,
                            idempotency_key=args.idempotency_key, **_request_kwargs(args))
    if not waiting:
        print(json.dumps(job.as_dict(), indent=2) if args.json else job.id)
        return 0
    # Said before the wait, so an interrupted one still leaves the id to come back to.
    print(f"glmimage: submitted {job.id}", file=sys.stderr)
    return _report_end(args, client, _follow(client, job))


def _jobs_wait(args: argparse.Namespace, client: Client) -> int:
    # Existing files are checked once the job has ended: its images' number and format are known only then.
    return _report_end(args, client, _follow(client, args.id))


def _jobs_get(args: argparse.Namespace, client: Client) -> int:
    job = client.get_job(args.id)
    print(json.dumps(job.as_dict(), indent=2) if args.json else format_job(job))
    return 0


def _jobs_cancel(args: argparse.Namespace, client: Client) -> int:
    job = client.cancel_job(args.id)
    if args.json:
        print(json.dumps(job.as_dict(), indent=2))
    elif job.status == "in_progress":
        print(f"{job.id} in_progress: cancelling (its runner stops it)")
    else:
        print(f"{job.id} {job.status}")
    return 0


def _jobs_list(args: argparse.Namespace, client: Client) -> int:
    if args.all:
        jobs, has_more = list(client.iter_jobs(args.status, page_size=args.limit)), False
    else:
        page = client.list_jobs(args.limit, args.after, args.status)
        jobs, has_more = page.jobs, page.has_more
    if args.json:
        print(json.dumps({"jobs": [j.as_dict() for j in jobs], "has_more": has_more}, indent=2))
    else:
        print(format_jobs(jobs))
    if has_more and not args.json:  # on stderr: stdout stays the table
        print(f"glmimage: more: glmimage jobs list --after {jobs[-1].id}", file=sys.stderr)
    return 0


JOB_COMMANDS = {"submit": _jobs_submit, "wait": _jobs_wait, "get": _jobs_get, "cancel": _jobs_cancel,
                "list": _jobs_list}


def _jobs(args: argparse.Namespace, client: Client) -> int:
    return JOB_COMMANDS[args.jobs_command](args, client)


COMMANDS = {"generate": _generate, "edit": _generate, "status": _status, "limits": _limits, "loras": _loras,
            "jobs": _jobs}


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
