"""An edit's conditioning on the denoiser: the reference images with their AR tokens, checked and turned into the
pipeline's image-to-image inputs.

Each reference arrives twice: its file (VAE-encoded into the DiT's KV cache) and its AR VQ codes, already upsampled
2x, on a grid of the reference's model size / 16. The pipeline fails unless each reference's VAE patch grid equals
its token grid, so every reference is resized to exactly grid x 16 pixels whatever its own size
(services.model.references.prepare, shared with the AR).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from PIL import Image

from runtime.errors import InvalidArgument
from runtime.limits import Limits, check_reference_images
from services.model.references import ReferenceTokens, prepare


def check_codes(ids: Sequence[int], field: str, codebook_size: int) -> None:
    """Every id a code of the DiT's prior embedding; the first one outside named with ``field``."""
    if ids and not (0 <= min(ids) and max(ids) < codebook_size):
        bad = next(t for t in ids if not 0 <= t < codebook_size)
        raise InvalidArgument(field, f"id {bad} is outside [0, {codebook_size})")


def check_references(images: Sequence[bytes], references: Sequence[ReferenceTokens], limits: Limits,
                     codebook_size: int) -> None:
    """Headers against the limits, one token grid per image, each grid sound; nothing is decoded here."""
    check_reference_images(images, limits)
    if len(references) != len(images):
        raise InvalidArgument("references", f"{len(references)} token grids for {len(images)} reference_images; "
                                            "an edit sends one per image, in the same order")
    for i, ref in enumerate(references):
        field = f"references[{i}]"
        if ref.grid_height < 1 or ref.grid_width < 1:
            raise InvalidArgument(field, f"grid {ref.grid_height}x{ref.grid_width} must be positive on both sides")
        width, height = ref.size
        if width * height > limits.max_pixels:
            # The DiT runs each reference at its grid's size: the same pixel budget as the target bounds its cost.
            raise InvalidArgument(field, f"grid {ref.grid_height}x{ref.grid_width} means a {height}x{width} "
                                         f"reference, over the limit of {limits.max_pixels} pixels")
        expected = ref.grid_height * ref.grid_width
        if len(ref.token_ids) != expected:
            raise InvalidArgument(field, f"has {len(ref.token_ids)} ids; its {ref.grid_height}x{ref.grid_width} "
                                         f"grid needs {expected}")
        check_codes(ref.token_ids, field, codebook_size)


def prepare_images(images: Sequence[bytes], references: Sequence[ReferenceTokens]) -> list[Image.Image]:
    """Each checked reference decoded and resized to its grid's size; InvalidArgument naming ``reference_images[i]``
    for data that does not decode whole (a truncated file behind a sound header)."""
    return [prepare(data, f"reference_images[{i}]", *ref.size)
            for i, (data, ref) in enumerate(zip(images, references, strict=True))]


def pipeline_inputs(pixels: Sequence[Image.Image], references: Sequence[ReferenceTokens],
                    device: torch.device) -> dict:
    """GlmImagePipeline's image-to-image arguments for one sample: the images, all references' codes concatenated
    and their (1, grid_h, grid_w) rows. Empty for text-to-image, so the pipeline's own defaults apply."""
    if not references:
        return {}
    ids = [t for ref in references for t in ref.token_ids]
    grids = [[1, ref.grid_height, ref.grid_width] for ref in references]
    return {"image": [list(pixels)],
            "prior_token_image_ids": [torch.tensor(ids, dtype=torch.long, device=device)],
            "source_image_grid_thw": [torch.tensor(grids, dtype=torch.long, device=device)]}


def is_reference_pass(kwargs: dict) -> bool:
    """Whether a DiT forward writes a reference into the KV cache (before the loop) rather than denoises a step."""
    caches = kwargs.get("kv_caches")
    return caches is not None and caches.num_layers > 0 and caches[0].mode == "write"
