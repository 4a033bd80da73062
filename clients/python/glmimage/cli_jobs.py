"""`glmimage jobs`: generations that outlive the connection (JobService): submit, follow, get, cancel, list, and
how a job is shown. glmimage.cli wires it in."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

from glmimage.cli_common import extension, print_usage, refuse_to_overwrite, request_args, request_kwargs, table
from glmimage.client import Client, Job
from glmimage.jobs import JOB_STATUSES

BASE_URL_ENV = "GLMIMAGE_BASE_URL"


def add_jobs_parser(sub: argparse._SubParsersAction, conn: argparse.ArgumentParser) -> None:
    """`glmimage jobs submit|get|wait|cancel|list`, its flags on top of ``conn`` (the connection's)."""
    jobs = sub.add_parser("jobs", help="generations that outlive the connection: submit, follow, cancel, list")
    jobs_sub = jobs.add_subparsers(dest="jobs_command", required=True)
    submit = jobs_sub.add_parser("submit", parents=[conn],
                                 help="submit a generation (an edit with --image) as a job; prints its id")
    submit.add_argument("prompt")
    request_args(submit)
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
    return table(["ID", "STATUS", "CREATED", "PROGRESS"], rows) if rows else "no jobs"


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
        refuse_to_overwrite(_job_files(args, len(job.images), job.extension), args.force)
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
            print_usage(job.usage, len(job.images))
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
        refuse_to_overwrite(_job_files(args, args.n, extension(args)), args.force)
    job = client.submit_job(args.prompt, images=args.image or None, webhook_url=args.webhook_url,
                            idempotency_key=args.idempotency_key, **request_kwargs(args))
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


def run_jobs(args: argparse.Namespace, client: Client) -> int:
    return JOB_COMMANDS[args.jobs_command](args, client)
