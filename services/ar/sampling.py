"""Per-row sampling and early stopping for one batched `model.generate` call.

transformers' generate() samples the whole batch from torch's one global RNG, so a row's tokens would depend on
its batch-mates. RowSampler samples every row with its own torch.Generator and hands generate() scores that are
-inf everywhere but the chosen token; generate() then runs greedy (do_sample=False) and picks exactly that token.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import LogitsProcessor, StoppingCriteria
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from services.ar.domain import RunControl, Sampling

# transformers' own fallbacks when neither the request nor the checkpoint's generation config sets a value.
HF_DEFAULTS = Sampling(temperature=1.0, top_p=1.0, top_k=50)


@dataclass(frozen=True)
class RowParams:
    temperature: float
    top_p: float
    top_k: int


def resolve(requested: Sampling, model_defaults: Sampling) -> RowParams:
    """Request value, else the checkpoint's generation config, else transformers' default (as generate() does)."""
    def pick(name: str):
        for source in (requested, model_defaults, HF_DEFAULTS):
            if (value := getattr(source, name)) is not None:
                return value
        raise AssertionError(name)

    return RowParams(temperature=float(pick("temperature")), top_p=float(pick("top_p")), top_k=int(pick("top_k")))


def warpers(params: RowParams) -> list[LogitsProcessor]:
    """The same warpers, in the same order and under the same conditions, as generate(do_sample=True) uses."""
    out: list[LogitsProcessor] = []
    if params.temperature != 1.0:
        out.append(TemperatureLogitsWarper(params.temperature))
    if params.top_k != 0:
        out.append(TopKLogitsWarper(top_k=params.top_k, min_tokens_to_keep=1))
    if params.top_p < 1.0:
        out.append(TopPLogitsWarper(top_p=params.top_p, min_tokens_to_keep=1))
    return out


@dataclass
class _Group:
    rows: torch.Tensor  # row indices sharing these parameters
    warpers: list[LogitsProcessor]
    generators: list[torch.Generator]
    whole_batch: bool


class RowSampler(LogitsProcessor):
    def __init__(self, params: Sequence[RowParams], generators: Sequence[torch.Generator], device: torch.device):
        by_params: dict[RowParams, list[int]] = {}
        for i, p in enumerate(params):
            by_params.setdefault(p, []).append(i)
        # Rows with equal parameters are warped together: the warpers work row by row, so this changes no value.
        self._groups = [
            _Group(rows=torch.tensor(rows, device=device), warpers=warpers(p),
                   generators=[generators[i] for i in rows], whole_batch=len(rows) == len(params))
            for p, rows in by_params.items()]

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        chosen = torch.empty(scores.shape[0], dtype=torch.long, device=scores.device)
        for g in self._groups:
            ids, raw = (input_ids, scores) if g.whole_batch else (input_ids[g.rows], scores[g.rows])
            s = raw
            for w in g.warpers:
                s = w(ids, s)
            probs = torch.softmax(s, dim=-1)
            # torch.multinomial(p, 1) is argmax(p / q) with q ~ Exp(1) drawn from its generator; drawing q row by
            # row from each row's own generator gives the same token a batch-1 multinomial with that seed gives.
            q = torch.empty_like(probs)
            for j, gen in enumerate(g.generators):
                q[j].exponential_(generator=gen)
            picked = (probs / q).argmax(dim=-1)
            # A temperature so small that logits / temperature overflow (a float32 denormal such as 1e-45) makes
            # softmax inf - inf = NaN, whose argmax is token 0. The limit of sampling as the temperature goes to 0
            # is the most likely token, which the warpers never remove: take it.
            overflowed = probs.isnan().any(dim=-1)
            if overflowed.any():
                picked = torch.where(overflowed, raw.argmax(dim=-1), picked)
            if g.whole_batch:
                chosen = picked
            else:
                chosen[g.rows] = picked
        out = torch.full_like(scores, float("-inf"))
        out.scatter_(1, chosen.unsqueeze(1), 0.0)
        return out


class ControlStop(StoppingCriteria):
    """Ends the whole batch at the next step once its caller is gone (cancelled or past its deadline)."""

    def __init__(self, control: RunControl) -> None:
        self.control = control

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
        self.control.steps_done += 1
        self.control.stepped.set()
        stop = self.control.stop_error() is not None
        return torch.full((input_ids.shape[0],), stop, dtype=torch.bool, device=input_ids.device)
