"""Prompt (and an edit's reference images) -> model inputs through the checkpoint's own GlmImageProcessor (chat
template + target-grid spec).

Shared by the local engine and the srt backend, so both send the model exactly the same tokens.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from services.ar.domain import GridPlan
from services.model.references import prepare_for_model

# Each reference's image tokens sit between an image start and an image end marker (the chat template's).
MARKERS_PER_REFERENCE = 2


@dataclass(frozen=True)
class EncodedPrompt:
    input_ids: list[int]  # unpadded, chat template, reference images and grid spec included
    # Text-to-image: (2, 3), the large target grid then the preview grid. An edit: each reference's grid, then the
    # one target grid.
    image_grid_thw: torch.Tensor
    plan: GridPlan
    references: int = 0  # reference images; their grids lead image_grid_thw
    pixel_values: torch.Tensor | None = None  # the references' patches (an edit only)

    @property
    def prompt_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def reference_grids(self) -> torch.Tensor:
        return self.image_grid_thw[:self.references]

    @property
    def image_tokens(self) -> int:
        """Of prompt_tokens, the references': one per vision patch of each grid, plus its two markers."""
        return int(self.reference_grids.prod(-1).sum()) + MARKERS_PER_REFERENCE * self.references


def grid_plan(image_grid_thw: torch.Tensor, references: int = 0) -> GridPlan:
    """Text-to-image: the processor lists the large grid first and the preview after it; the model emits the preview
    first. An edit: the target grid comes last, after the references', and there is no preview."""
    sizes = [(int(h), int(w)) for _, h, w in image_grid_thw.tolist()]
    if references:
        target_h, target_w = sizes[-1]
        return GridPlan(preview_tokens=0, grid_h=target_h, grid_w=target_w)
    large_h, large_w = sizes[0]
    preview = sum(h * w for h, w in sizes) - large_h * large_w
    return GridPlan(preview_tokens=preview, grid_h=large_h, grid_w=large_w)


class PromptEncoder:
    def __init__(self, processor) -> None:
        self.processor = processor
        tok = processor.tokenizer
        # Padding is masked out, so any id works when a tokenizer has no pad token.
        self.pad_token_id: int = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
        # The image processor's own bounds: references are sized within them, so it never rescales one and each
        # reference's grid is exactly its model size / 32.
        size = processor.image_processor.size
        self.reference_pixels: tuple[int, int] = (int(size["shortest_edge"]), int(size["longest_edge"]))

    @classmethod
    def load(cls, root: Path) -> PromptEncoder:
        from transformers import GlmImageProcessor

        return cls(GlmImageProcessor.from_pretrained(root / "processor"))

    def encode(self, prompt: str, height: int, width: int, reference_images: Sequence[bytes] = ()) -> EncodedPrompt:
        """Text-to-image, or an edit when reference_images are given (headers already checked against the limits;
        data that does not decode raises InvalidArgument naming ``reference_images[i]``)."""
        images = [prepare_for_model(data, f"reference_images[{i}]", *self.reference_pixels)
                  for i, data in enumerate(reference_images)]
        # The layout GlmImagePipeline builds: the references first, then the text.
        content = [*({"type": "image", "image": image} for image in images), {"type": "text", "text": prompt}]
        enc = self.processor.apply_chat_template(
            [[{"role": "user", "content": content}]], tokenize=True, return_dict=True,
            processor_kwargs={"padding": False, "target_h": height, "target_w": width, "return_tensors": "pt"})
        grids = enc["image_grid_thw"]
        return EncodedPrompt(input_ids=enc["input_ids"][0].tolist(), image_grid_thw=grids,
                             plan=grid_plan(grids, len(images)), references=len(images),
                             pixel_values=enc.get("pixel_values") if images else None)

    def text(self, encoded: EncodedPrompt) -> str:
        """The exact prompt text the model sees, special tokens included (for servers that tokenize themselves)."""
        return self.processor.tokenizer.decode(encoded.input_ids, skip_special_tokens=False)
