"""The embedded default model: a tiny random-weight GLM-Image built offline from the real classes.

It is written once with `save_pretrained` in the real checkpoint layout, so both services load it through
exactly the code path used for `--model-path /path/to/GLM-Image`. Nothing is downloaded.
"""
from __future__ import annotations

import fcntl
import logging
import os
import shutil
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

# Bump when the architecture below changes, so stale caches are rebuilt rather than half-loaded.
TINY_VERSION = "tiny-v1"
# Visual codebook: AR lm_head vision vocab == DiT prior embedding size (real model: 16512 / 16384).
CODEBOOK = 128
# Content-only template, as the real processor effectively uses for t2i.
CHAT_TEMPLATE = (
    "{%- for m in messages -%}{%- if m.content is string -%}{{ m.content }}{%- else -%}"
    "{%- for item in m.content -%}{%- if item.type == 'image' -%}<|dit_token_16384|><|image|><|dit_token_16385|>"
    "{%- elif item.type == 'text' -%}{{ item.text }}{%- endif -%}{%- endfor -%}{%- endif -%}{%- endfor -%}"
)
# Subfolders of a full GLM-Image checkpoint, split by the service that loads them.
AR_PARTS = ("processor", "vision_language_encoder")
DENOISER_PARTS = ("tokenizer", "text_encoder", "transformer", "vae", "scheduler")


def default_cache_dir() -> Path:
    base = os.environ.get("GLMIMAGE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "glmimage"
    )
    return Path(base) / TINY_VERSION


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
    processor = GlmImageProcessor(image_processor=GlmImageImageProcessorPil(), tokenizer=ar_tok,
                                  chat_template=CHAT_TEMPLATE)
    torch.manual_seed(seed)
    ar = GlmImageForConditionalGeneration(GlmImageConfig(
        text_config=dict(vocab_size=len(ar_tok), hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=512,
                         vision_vocab_size=CODEBOOK, rope_parameters={"mrope_section": (4, 2, 2)},
                         pad_token_id=ar_tok.pad_token_id, eos_token_id=ar_tok.eos_token_id),
        vision_config=dict(depth=2, hidden_size=32, num_heads=2, image_size=32, patch_size=8, intermediate_size=32),
        vq_config=dict(embed_dim=32, num_embeddings=CODEBOOK, latent_channels=32),
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


def _is_complete(path: Path) -> bool:
    return (path / "model_index.json").is_file() and all((path / p).is_dir() for p in AR_PARTS + DENOISER_PARTS)


def ensure_tiny_checkpoint(path: Path | None = None) -> Path:
    """Return a directory holding the tiny checkpoint, writing it first if missing.

    Safe when several servers start at once: one builds under an exclusive lock into a temporary
    directory and renames it into place; the others wait on the lock and then reuse it.
    """
    path = Path(path) if path else default_cache_dir()
    if _is_complete(path):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _is_complete(path):
            return path
        log.info("writing the tiny GLM-Image checkpoint to %s", path)
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
        try:
            build_tiny_pipeline().save_pretrained(tmp)
            if path.exists():
                shutil.rmtree(path)
            tmp.rename(path)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
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
