"""Prompt -> model input ids through the checkpoint's own GlmImageProcessor (chat template + target-grid spec).

Shared by the local engine and the srt backend, so both send the model exactly the same tokens.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from services.ar.domain import GridPlan


@dataclass(frozen=True)
class EncodedPrompt:
    input_ids: list[int]  # unpadded, chat template and grid spec included
    image_grid_thw: torch.Tensor  # (2, 3): the large target grid, then the preview grid
    plan: GridPlan

    @property
    def prompt_tokens(self) -> int:
        return len(self.input_ids)


def grid_plan(image_grid_thw: torch.Tensor) -> GridPlan:
    """The processor lists the large grid first and the preview after it; the model emits the preview first."""
    sizes = [(int(h), int(w)) for _, h, w in image_grid_thw.tolist()]
    large_h, large_w = sizes[0]
    preview = sum(h * w for h, w in sizes) - large_h * large_w
    return GridPlan(preview_tokens=preview, grid_h=large_h, grid_w=large_w)


class PromptEncoder:
    def __init__(self, processor) -> None:
        self.processor = processor
        tok = processor.tokenizer
        # Padding is masked out, so any id works when a tokenizer has no pad token.
        self.pad_token_id: int = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)

    @classmethod
    def load(cls, root: Path) -> PromptEncoder:
        from transformers import GlmImageProcessor

        return cls(GlmImageProcessor.from_pretrained(root / "processor"))

    def encode(self, prompt: str, height: int, width: int) -> EncodedPrompt:
        messages = [[{"role": "user", "content": [{"type": "text", "text": prompt}]}]]
        enc = self.processor.apply_chat_template(
            messages, tokenize=True, return_dict=True,
            processor_kwargs={"padding": False, "target_h": height, "target_w": width, "return_tensors": "pt"})
        grids = enc["image_grid_thw"]
        return EncodedPrompt(input_ids=enc["input_ids"][0].tolist(), image_grid_thw=grids, plan=grid_plan(grids))

    def text(self, encoded: EncodedPrompt) -> str:
        """The exact prompt text the model sees, special tokens included (for servers that tokenize themselves)."""
        return self.processor.tokenizer.decode(encoded.input_ids, skip_special_tokens=False)
