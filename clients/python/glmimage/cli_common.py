"""What the CLI's subcommands share (glmimage.cli, glmimage.cli_jobs): the request flags and their keyword
arguments, the file extension, the overwrite check, the usage line and the plain table."""
from __future__ import annotations

import argparse
from pathlib import Path

from glmimage.client import FORMATS, Usage
from glmimage.messages import PRIORITIES, STEP_CACHE_LEVELS, Lora
from glmimage.wire.sizes import size_arg


def lora_arg(text: str) -> Lora:
    """argparse type of --lora: a bad value is a usage error (exit 2) naming the flag."""
    try:
        return Lora.parse(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME[:SCALE], SCALE a finite number "
                                         "(e.g. tiny-style or tiny-style:0.8)") from None


def request_args(parser: argparse.ArgumentParser) -> None:
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


def request_kwargs(args: argparse.Namespace) -> dict[str, object]:
    return dict(n=args.n, size=args.size, output_format=args.format, output_compression=args.compression,
                seed=args.seed, steps=args.steps, guidance=args.guidance, step_cache=args.step_cache,
                loras=args.lora, priority=args.priority)


def extension(args: argparse.Namespace) -> str:
    return {"jpeg": "jpg"}.get(args.format or "png", args.format or "png")


def print_usage(usage: Usage, images: int) -> None:
    print(f"usage: prompt_tokens={usage.prompt_tokens} completion_tokens={usage.completion_tokens} "
          f"total_tokens={usage.total_tokens} cached_tokens={usage.cached_tokens} image_tokens={usage.image_tokens} "
          f"images={images}")


def refuse_to_overwrite(paths: list[Path], force: bool) -> None:
    """Checked before the request, so an earlier run's images are neither lost nor paid for again. (The writes
    themselves refuse too, for a file that appears meanwhile.)"""
    existing = [p for p in paths if p.exists()]
    if existing and not force:
        more = f" (and {len(existing) - 1} more)" if len(existing) > 1 else ""
        raise FileExistsError(f"{existing[0]} exists{more}; --force overwrites, or choose another -o or --name")


def table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
                     for row in [header, *rows])
