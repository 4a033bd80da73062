"""Prometheus metrics of the denoiser, on the default registry (served by --metrics-port)."""
from __future__ import annotations

import enum

from prometheus_client import Counter, Gauge, Histogram


class Outcome(enum.StrEnum):
    OK = "ok"
    CANCELLED = "cancelled"  # stopped early: client cancel or passed deadline
    FAILED = "failed"
    REJECTED_BUSY = "rejected_busy"
    INVALID = "invalid"


class StepKind(enum.StrEnum):
    FULL = "full"  # the DiT's blocks ran
    CACHED = "cached"  # extrapolated by the step cache


class CancelReason(enum.StrEnum):
    CLIENT = "client"
    DEADLINE = "deadline"


JOBS = Counter("glmimage_denoiser_jobs_total", "Denoise jobs by outcome", ["outcome"])
CANCELLED_JOBS = Counter("glmimage_denoiser_cancelled_jobs_total",
                         "Jobs stopped before their last step because nobody waited any more", ["reason"])
# How promptly a cancel frees the slot, in steps: 0 or 1 (the step in flight) is the contract; more means the
# engine is not checking the cancel flag between steps.
STEPS_AFTER_CANCEL = Histogram("glmimage_denoiser_steps_after_cancel",
                               "Steps that finished after a cancel reached the worker, per cancelled job",
                               buckets=(0, 1, 2, 5, 10))
STEPS = Counter("glmimage_denoiser_steps_total", "Denoising steps run, computed in full or cached (extrapolated)",
                ["kind"])
BUSY = Gauge("glmimage_denoiser_busy", "Jobs holding the slot (0 or 1 per denoiser)")
# The proof a scrape can miss in BUSY: the most jobs that ever held the slot at once since start (1 = never two,
# whichever gateways sent them).
BUSY_MAX = Gauge("glmimage_denoiser_busy_max", "Most jobs that held the slot at once since the process started")
# Buckets span the tiny model on a CPU (milliseconds) up to real weights at 2048x2048.
STEP_SECONDS = Histogram("glmimage_denoiser_step_seconds", "One denoising step (DiT forward(s) + scheduler)",
                         buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0))
DENOISE_SECONDS = Histogram("glmimage_denoiser_denoise_seconds", "Glyph encoding and the whole denoising loop",
                            buckets=(0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0))
DECODE_SECONDS = Histogram("glmimage_denoiser_decode_seconds", "VAE decode of the final latents, with the crop",
                           buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0))
ENCODE_SECONDS = Histogram("glmimage_denoiser_encode_seconds", "Pillow encoding of the final image",
                           buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0))
# LoRA adapters (services.denoiser.adapters): a hit is a job's adapter already loaded, a miss one read from disk
# (then loaded, or refused); an eviction frees room at --max-loaded-loras, or drops a file replaced on disk.
LORA_LOADS = Counter("glmimage_denoiser_lora_loads_total", "LoRA adapters loaded into the DiT")
LORA_HITS = Counter("glmimage_denoiser_lora_hits_total", "Adapters a job named that were already loaded")
LORA_MISSES = Counter("glmimage_denoiser_lora_misses_total", "Adapters a job named that had to be read from disk")
LORA_EVICTIONS = Counter("glmimage_denoiser_lora_evictions_total", "LoRA adapters removed from the DiT")
LORAS_LOADED = Gauge("glmimage_denoiser_loras_loaded", "LoRA adapters held loaded in the DiT")

# --compile: graphs torch compiled since start. It rises during warm-up, before SERVING; a rise afterwards is a
# request the warm-up did not cover (a size not in --compile-sizes, more references), compiled in that request.
COMPILATIONS = Counter("glmimage_denoiser_compilations_total",
                       "Graphs torch.compile compiled for the DiT's blocks (--compile), warm-up included")

# Every label value is exported from the start, so rates work before the first event of a kind.
for _outcome in Outcome:
    JOBS.labels(_outcome)
for _reason in CancelReason:
    CANCELLED_JOBS.labels(_reason)
for _kind in StepKind:
    STEPS.labels(_kind)
