"""The embedded default model: a tiny random-weight GLM-Image built offline from the real classes.

It is written once with `save_pretrained` in the real checkpoint layout, so both services load it through
exactly the code path used for `--model-path /path/to/GLM-Image`. Nothing is downloaded.

Image editing (since tiny-v2; tests/test_tiny_edit.py), as the installed diffusers/transformers do it:
- AR: a chat of one user turn, content = the reference image items, then the text, through
  `processor.apply_chat_template(chats, tokenize=True, target_h=H, target_w=W, padding=..., return_dict=True,
  return_tensors="pt")`. A reference of h x w (sides multiples of 32) adds (h/32)*(w/32) `<|image|>` tokens plus its
  start/end markers to input_ids and attention_mask; `image_grid_thw` lists every reference's grid, then ONE target
  grid (1, H/32, W/32) (t2i: target + preview); `images_per_sample` = references + 1. Plan: the target grid only,
  max_new_tokens = (H/32)*(W/32) + 1. One generate call shares one target size and one reference count.
- Reference priors: `get_image_features(pixel_values, reference_grids).pooler_output` (a list of (C, h, w)) straight
  into `get_image_tokens`, each image's codes upsampled 2x; grids doubled in h and w.
- DiT: `pipe(prompt, image=[[PIL...]], prior_token_ids=(1, H/16*W/16), prior_token_image_ids=[codes of all
  references], source_image_grid_thw=[(n_refs, 3)], height, width)` with no AR parts; `image` is required (the VAE
  encodes it at its own size), so each reference's VAE patch grid must equal its doubled AR grid.
"""
from __future__ import annotations

import fcntl
import logging
import shutil
import tempfile
from pathlib import Path

from runtime.paths import cache_root

log = logging.getLogger(__name__)

# Bump when the architecture below changes, so stale caches are rebuilt rather than half-loaded.
TINY_VERSION = "tiny-v3"  # v3: one AR decoder layer (v2: two), a third less CPU a token
# Visual codebook: AR lm_head vision vocab == VQ codebook == DiT prior embedding size (real: 16512 / 16384 / 16384).
CODEBOOK = 128
# Vision patch edge, as the real model: the processor halves a reference then cuts it into 16-pixel patches, so one
# VQ token covers 32 pixels; upsampled 2x it lands on the DiT's 16-pixel latent patch (VAE 8 x transformer patch 2).
VISION_PATCH = 16
# The vision encoder hidden size is what the VQ quantises (its latent_channels).
VISION_HIDDEN = 32
# Content-only template, as the real processor effectively uses: each image item is <image start><|image|><image end>;
# the processor widens <|image|> to one token per vision patch and appends the target grid marker(s) itself.
CHAT_TEMPLATE = (
    "{%- for m in messages -%}{%- if m.content is string -%}{{ m.content }}{%- else -%}"
    "{%- for item in m.content -%}{%- if item.type == 'image' -%}<|dit_token_16384|><|image|><|dit_token_16385|>"
    "{%- elif item.type == 'text' -%}{{ item.text }}{%- endif -%}{%- endfor -%}{%- endif -%}{%- endfor -%}"
)
# Subfolders of a full GLM-Image checkpoint, split by the service that loads them.
AR_PARTS = ("processor", "vision_language_encoder")
DENOISER_PARTS = ("tokenizer", "text_encoder", "transformer", "vae", "scheduler")


def default_cache_dir() -> Path:
    return cache_root() / TINY_VERSION


def _build_ar_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # ids 0..127 visual codes, 128 image start/BOS, 129 image end/EOS, then byte-level symbols, then specials.
    vocab = {f"<|dit_token_{i}|>": i for i in range(CODEBOOK)}
    vocab["<|dit_token_16384|>"] = CODEBOOK
    vocab["<|dit_token_16385|>"] = CODEBOOK + 1
    # sorted(): ByteLevel.alphabet() order varies per process, and ids must not.
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab.setdefault(ch, len(vocab))
    for special in ["<|endoftext|>", "<sop>", "<eop>", "<|image|>"]:
        vocab[special] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|dit_token_16384|>", eos_token="<|dit_token_16385|>",
        pad_token="<|endoftext|>", padding_side="left",
        extra_special_tokens={"image_token": "<|image|>", "grid_bos_token": "<sop>", "grid_eos_token": "<eop>"},
    )


def build_tiny_pipeline(seed: int = 0):
    """The full GlmImagePipeline with tiny random weights (deterministic for a given seed)."""
    import torch
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        GlmImagePipeline,
        GlmImageTransformer2DModel,
    )
    from transformers import (
        ByT5Tokenizer,
        GlmImageConfig,
        GlmImageForConditionalGeneration,
        GlmImageImageProcessorPil,
        GlmImageProcessor,
        T5Config,
        T5EncoderModel,
    )

    ar_tok = _build_ar_tokenizer()
    # One patch per token and no temporal frames: the vision patch embed reads 3 x 16 x 16 values per patch and the VQ
    # emits one code per patch. min_pixels stays small so a tiny-sized reference is not upscaled (an upscaled reference
    # yields more VQ codes than its VAE latent has patches, and the DiT cannot add them).
    image_processor = GlmImageImageProcessorPil(patch_size=VISION_PATCH, temporal_patch_size=1, merge_size=1,
                                                min_pixels=32 * 32, max_pixels=1024 * 1024)
    processor = GlmImageProcessor(image_processor=image_processor, tokenizer=ar_tok, chat_template=CHAT_TEMPLATE)
    torch.manual_seed(seed)
    ar = GlmImageForConditionalGeneration(GlmImageConfig(
        text_config=dict(vocab_size=len(ar_tok), hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=512,
                         vision_vocab_size=CODEBOOK, rope_parameters={"mrope_section": (4, 2, 2)},
                         pad_token_id=ar_tok.pad_token_id, eos_token_id=ar_tok.eos_token_id),
        vision_config=dict(depth=2, hidden_size=VISION_HIDDEN, num_heads=2, image_size=4 * VISION_PATCH,
                           patch_size=VISION_PATCH, spatial_merge_size=1, intermediate_size=32),
        vq_config=dict(embed_dim=32, num_embeddings=CODEBOOK, latent_channels=VISION_HIDDEN),
        image_token_id=ar_tok.convert_tokens_to_ids("<|image|>"),
        image_start_token_id=ar_tok.bos_token_id, image_end_token_id=ar_tok.eos_token_id)).eval()
    glyph_tok = ByT5Tokenizer()  # byte-level: needs no vocab file, like the real checkpoint's ByT5
    torch.manual_seed(seed)
    text_encoder = T5EncoderModel(T5Config(vocab_size=len(glyph_tok), d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                           num_heads=4, relative_attention_num_buckets=8)).eval()
    torch.manual_seed(seed)
    transformer = GlmImageTransformer2DModel(  # patch_size * vae_scale_factor must be 16
        patch_size=2, in_channels=4, out_channels=4, num_layers=2, attention_head_dim=8, num_attention_heads=2,
        text_embed_dim=32, time_embed_dim=16, condition_dim=8, prior_vq_quantizer_codebook_size=CODEBOOK)
    torch.manual_seed(seed)
    vae = AutoencoderKL(block_out_channels=(4, 8, 16, 16), in_channels=3, out_channels=3,
                        down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4,
                        latent_channels=4, norm_num_groups=4, sample_size=128,
                        latents_mean=[0.0] * 4, latents_std=[1.0] * 4)
    return GlmImagePipeline(tokenizer=glyph_tok, processor=processor, text_encoder=text_encoder,
                            vision_language_encoder=ar, vae=vae, transformer=transformer,
                            scheduler=FlowMatchEulerDiscreteScheduler())


# The demo LoRA adapter (docs/configuration.md, "LoRA adapters"): random weights on the tiny DiT's attention
# projections, in diffusers' file layout, in the checkpoint's own loras/ folder, so TINY_VERSION rebuilds it too.
TINY_LORA = "tiny-style"
TINY_LORA_RANK = 4
_TINY_LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]


def tiny_lora_dir(checkpoint: Path) -> Path:
    return Path(checkpoint) / "loras"


def build_tiny_lora(transformer, directory: Path, name: str = TINY_LORA, seed: int = 1,
                    std: float = 0.5) -> Path:
    """Write ``name``.safetensors (and its sidecar) into ``directory``: a rank-4 LoRA with random weights of
    ``seed`` on ``transformer``, saved by diffusers' own ``save_lora_adapter``; the transformer is left as it was."""
    import json

    import torch
    from peft import LoraConfig

    transformer.add_adapter(LoraConfig(r=TINY_LORA_RANK, lora_alpha=TINY_LORA_RANK,
                                       target_modules=_TINY_LORA_TARGETS), adapter_name=name)
    try:
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for param_name, param in sorted(transformer.named_parameters()):
                if f".{name}." in param_name:  # peft's own init leaves lora_B at zero: no effect to see
                    param.copy_(torch.randn(param.shape, generator=generator) * std)
        transformer.save_lora_adapter(directory, adapter_name=name, weight_name=f"{name}.safetensors")
    finally:
        transformer.delete_adapters(name)
    (directory / f"{name}.json").write_text(json.dumps(
        {"scale": 1.0, "description": "a demo adapter of random weights for the tiny model"}, indent=2) + "\n")
    return directory / f"{name}.safetensors"


def ensure_tiny_lora(checkpoint: Path) -> Path | None:
    """The tiny checkpoint's adapter directory, written first if missing; None where peft is not installed (the
    denoiser then serves no adapters)."""
    import importlib.util

    loras = tiny_lora_dir(checkpoint)
    if (loras / f"{TINY_LORA}.safetensors").is_file():
        return loras
    if importlib.util.find_spec("peft") is None:
        log.warning("peft is not installed: no demo LoRA adapter for the tiny model")
        return None
    with open(checkpoint.parent / f".{checkpoint.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (loras / f"{TINY_LORA}.safetensors").is_file():
            return loras
        from diffusers import GlmImageTransformer2DModel

        log.info("writing the tiny model's demo LoRA adapter %s to %s", TINY_LORA, loras)
        tmp = Path(tempfile.mkdtemp(prefix=".loras-", dir=checkpoint))
        try:
            build_tiny_lora(GlmImageTransformer2DModel.from_pretrained(checkpoint / "transformer"), tmp)
            if loras.exists():
                shutil.rmtree(loras)
            tmp.rename(loras)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return loras


def _is_complete(path: Path) -> bool:
    return (path / "model_index.json").is_file() and all((path / p).is_dir() for p in AR_PARTS + DENOISER_PARTS)


def ensure_tiny_checkpoint(path: Path | None = None) -> Path:
    """Return a directory holding the tiny checkpoint (and its demo LoRA adapter), writing it first if missing.

    Safe when several servers start at once: one builds under an exclusive lock into a temporary
    directory and renames it into place; the others wait on the lock and then reuse it.
    """
    path = Path(path) if path else default_cache_dir()
    if _is_complete(path):
        ensure_tiny_lora(path)
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not _is_complete(path):
            log.info("writing the tiny GLM-Image checkpoint to %s", path)
            tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
            try:
                build_tiny_pipeline().save_pretrained(tmp)
                if path.exists():
                    shutil.rmtree(path)
                tmp.rename(path)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    ensure_tiny_lora(path)  # after the lock: it takes the same one
    return path


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description="Write the tiny GLM-Image checkpoint (no downloads).")
    parser.add_argument("--path", type=Path, default=None, help=f"default: {default_cache_dir()}")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    print(ensure_tiny_checkpoint(args.path))  # the path is the command's output, for scripts


if __name__ == "__main__":
    main()
