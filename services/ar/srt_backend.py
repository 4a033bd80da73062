"""An external AR backend: an sglang-style HTTP `/generate` server, with usage taken from its `meta_info`.

The prompt is formatted locally with the checkpoint's processor (chat template + target-grid spec), so the
server receives exactly the text the local engine would tokenize. A batch goes out as one request with list-valued
`text` and `sampling_params` (one entry per output row, each with its own `sampling_seed`), which such servers
batch themselves. Only the processor is loaded: no weights, no torch model. Edits are refused (INVALID_ARGUMENT):
their reference images enter the model as pixels, which a text prompt cannot carry.
"""
from __future__ import annotations

import json
import logging
import secrets
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from runtime.errors import DeadlineExceeded, InvalidArgument, ServiceError, Unavailable
from runtime.limits import SEED_SPACE, Limits
from services.ar.domain import (
    ArRequest,
    ArResult,
    RunControl,
    Usage,
    prior_output,
    row_seeds,
    validate,
)
from services.ar.prompts import PromptEncoder
from services.model.loading import checkpoint_root, require_parts

log = logging.getLogger(__name__)

DEFAULT_LIMITS = Limits()


def generate_url(url: str) -> str:
    """Accept the server's base URL or its /generate URL."""
    url = url.rstrip("/")
    return url if url.endswith("/generate") else f"{url}/generate"


def _codebook_size(root: Path) -> int | None:
    """The VQ codebook size from the AR config when the directory has it (ids outside it would break the DiT)."""
    config = root / "vision_language_encoder" / "config.json"
    try:
        return int(json.loads(config.read_text())["vq_config"]["num_embeddings"])
    except (OSError, KeyError, TypeError, ValueError):
        return None


@dataclass(frozen=True)
class _Row:
    request: int
    prompt_tokens: int  # our own count, used when the server reports none
    text: str
    seed: int
    sampling_params: dict[str, Any]


class SrtBackend:
    def __init__(self, url: str, prompts: PromptEncoder, limits: Limits = DEFAULT_LIMITS, *,
                 timeout: float = 600.0, codebook_size: int | None = None) -> None:
        self.url = generate_url(url)
        self.prompts = prompts
        self.limits = limits
        self.device_name = "srt"  # the model runs on the srt server, on whatever device it has
        self.timeout = timeout
        self.codebook_size = codebook_size
        tok = prompts.processor.tokenizer
        self.eos_token_ids = frozenset([tok.eos_token_id]) if tok.eos_token_id is not None else frozenset()

    @classmethod
    def load(cls, model_path: str | Path | None, url: str, limits: Limits = DEFAULT_LIMITS, *,
             timeout: float = 600.0) -> SrtBackend:
        root = checkpoint_root(model_path)
        require_parts(root, ("processor",), "AR service with --backend srt")
        log.info("AR backend: %s (prompts formatted with %s)", generate_url(url), root / "processor")
        return cls(url, PromptEncoder.load(root), limits, timeout=timeout, codebook_size=_codebook_size(root))

    def validate(self, req: ArRequest) -> ArRequest:
        if req.reference_images:
            # The references enter the model as pixels (vision patches), which a text /generate call cannot carry.
            raise InvalidArgument("reference_images", "the srt backend does not support edits")
        return validate(req, self.limits)

    def generate(self, requests: Sequence[ArRequest], control: RunControl | None = None) -> list[ArResult]:
        if control is not None:
            control.check()
        t0 = time.perf_counter()
        encoded = [self.prompts.encode(r.prompt, r.height, r.width) for r in requests]
        plan = encoded[0].plan
        rows: list[_Row] = []
        for i, (req, enc) in enumerate(zip(requests, encoded, strict=True)):
            text = self.prompts.text(enc)
            sampling = {k: v for k, v in (("temperature", req.sampling.temperature), ("top_p", req.sampling.top_p),
                                          ("top_k", req.sampling.top_k)) if v is not None}
            for seed in row_seeds(req, secrets.randbelow(SEED_SPACE)):
                rows.append(_Row(i, enc.prompt_tokens, text, seed,
                                 {"max_new_tokens": plan.max_new_tokens, "sampling_seed": seed, **sampling}))
        answers = self._post({"text": [r.text for r in rows], "sampling_params": [r.sampling_params for r in rows]},
                             control)
        if len(answers) != len(rows):
            raise ServiceError(f"srt backend: {len(answers)} results for {len(rows)} rows")
        outputs: list[list] = [[] for _ in requests]
        for i, (row, answer) in enumerate(zip(rows, answers, strict=True)):
            ids, meta = _parse(answer, i)
            out = prior_output(ids, plan, seed=row.seed, prompt_tokens=row.prompt_tokens,
                               eos_token_ids=self.eos_token_ids, codebook_size=self.codebook_size, index=i)
            # The server's own accounting is authoritative (it knows what its prefix cache served); our count
            # fills in what it leaves out.
            usage = Usage(
                prompt_tokens=_or(meta.get("prompt_tokens"), out.usage.prompt_tokens),
                completion_tokens=_or(meta.get("completion_tokens"), out.usage.completion_tokens),
                cached_tokens=_or(meta.get("cached_tokens"), 0))
            outputs[row.request].append(replace(out, usage=usage))
        log.info("srt batch: %d request(s), %d row(s) in %.2fs", len(requests), len(rows), time.perf_counter() - t0)
        return [ArResult(outputs=o, height=r.height, width=r.width) for o, r in zip(outputs, requests, strict=True)]

    def _post(self, payload: dict[str, Any], control: RunControl | None) -> list[Any]:
        timeout = self.timeout
        if control is not None and control.deadline is not None:
            timeout = min(timeout, control.deadline - time.monotonic())
            if timeout <= 0:
                raise DeadlineExceeded("the deadline passed")
        req = urllib.request.Request(self.url, data=json.dumps(payload).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                body = json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            detail = exc.read()[:200].decode(errors="replace")
            log.warning("srt backend %s: HTTP %d: %s", self.url, exc.code, detail)
            raise Unavailable(f"AR backend returned HTTP {exc.code}") from None
        except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
            log.warning("srt backend %s: %s", self.url, exc)
            raise Unavailable("AR backend unreachable") from None
        except ValueError:
            raise ServiceError("AR backend returned a body that is not JSON") from None
        return body if isinstance(body, list) else [body]

    def warm_up(self) -> None:
        self.generate([ArRequest(prompt="warm-up", n=1, height=64, width=64, seed=0)])


def _or(value: int | None, fallback: int) -> int:
    return fallback if value is None else value


def _parse(answer: Any, index: int) -> tuple[list[int], dict[str, int]]:
    try:
        ids = [int(t) for t in answer["output_ids"]]
        info = answer["meta_info"]
        meta = {k: int(info[k]) for k in ("prompt_tokens", "completion_tokens", "cached_tokens")
                if info.get(k) is not None}
    except (KeyError, TypeError, ValueError, AttributeError):
        raise ServiceError(f"srt backend: result {index} lacks output_ids or meta_info") from None
    return ids, meta
