"""LoRA adapters in the denoiser: the adapter directory, each file checked before it touches the model, and the
adapters held loaded in the DiT (an LRU), switched per job. Everything but ``resolve`` runs on the engine's worker
thread, which owns the transformer.

The directory (``--lora-dir``) holds ``NAME.safetensors``, or a folder ``NAME/`` in diffusers' layout
(``NAME/pytorch_lora_weights.safetensors``), each with an optional sidecar ``NAME.json``: ``{"scale": 0.8,
"description": "..."}``. A request names adapters, never paths: a name is checked (runtime.limits) before
anything on disk is looked up. Links are followed only within the directory: every path is resolved first and one
that leads outside it (or to nothing) is refused without being opened, so nothing outside the directory is ever read.
A file whose name is not an adapter name is left out; each refusal is logged once per process, not at every listing.

A file is read once, whole (it is within max_lora_bytes), and checked from those bytes: a safetensors header that
fits the file (not truncated), only ``<module>.lora_A.weight`` / ``<module>.lora_B.weight`` keys (optionally under
``transformer.``) naming linear layers of this DiT with matching shapes, and a rank within max_lora_rank. Only then
is it handed to diffusers (``load_lora_adapter``) as a state dict, so what was checked is what is loaded. The file's
``lora_alpha`` (diffusers' metadata) is folded into lora_B, so peft runs every adapter at alpha == rank.

Per job the transformer runs exactly the job's adapters at their scales (``set_adapters``); a job without any, or
with every scale 0, runs with LoRA disabled: peft's layers then call the untouched base layer, so the image is the
base model's byte for byte, whatever is loaded.
"""
from __future__ import annotations

import itertools
import json
import logging
import math
import os
import struct
import time
import warnings
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from runtime.errors import InvalidArgument
from runtime.limits import MAX_LORA_SCALE, Limits, check_lora_name, check_lora_names, check_loras
from services.denoiser import metrics

log = logging.getLogger(__name__)

SUFFIX = ".safetensors"
FOLDER_WEIGHTS = "pytorch_lora_weights.safetensors"  # diffusers' file name inside a folder adapter
SIDECAR_MAX_BYTES = 64 << 10
PREFIX = "transformer."  # diffusers' pipeline-level layout names the DiT's keys so
_PARTS = (".lora_A.weight", ".lora_B.weight")
_DTYPE_BYTES = {"F16": 2, "BF16": 2, "F32": 4}
_METADATA_KEY = "lora_adapter_metadata"  # diffusers' LoraConfig, as JSON in the safetensors metadata


@dataclass(frozen=True)
class LoraRef:
    name: str
    scale: float | None = None  # None: the adapter's default (its sidecar's, else 1)


@dataclass(frozen=True)
class AdapterInfo:
    name: str
    path: Path  # the safetensors file
    default_scale: float = 1.0
    description: str = ""
    size_bytes: int = 0  # of the weights file, when found


class AdapterError(ValueError):
    """An adapter file or sidecar that fails its checks; the message completes "adapter NAME ..."."""


def _signature(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_mtime_ns, st.st_size


class AdapterDirectory:
    """The adapters an operator put in one directory, looked up by name only."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).expanduser()
        if not self.root.is_dir():
            raise ValueError(f"--lora-dir {self.root}: not a directory")
        self.real = self.root.resolve(strict=True)  # what every adapter path must resolve within

    def _inside(self, path: Path) -> Path | None:
        """``path`` with every link followed, None when nothing is there; AdapterError when it is a link that leads
        outside the directory, to nothing, or round in a loop. Only stats: nothing is opened."""
        shown = path.relative_to(self.root)
        try:
            real = path.resolve(strict=True)
        except FileNotFoundError:
            if path.is_symlink() or (path.parent != self.root and path.parent.is_symlink()):
                raise AdapterError(f"has {shown}, a link to nothing") from None
            return None
        except (OSError, RuntimeError):  # a loop of links: RuntimeError before Python 3.13
            raise AdapterError(f"has {shown}, a link that cannot be followed") from None
        if not real.is_relative_to(self.real):
            raise AdapterError(f"has {shown}, a link that leads outside the adapter directory")
        return real

    def _weights(self, name: str) -> Path | None:
        """The resolved weights file of ``name``: the plain file first, else the folder's. One that leads outside is
        refused (AdapterError), not passed over for the other form."""
        for path in (self.root / f"{name}{SUFFIX}", self.root / name / FOLDER_WEIGHTS):
            real = self._inside(path)
            if real is not None and real.is_file():
                return real
        return None

    def _candidates(self) -> list[str]:
        """The names the directory's entries stand for, of the allowed form (the others logged once, left out)."""
        found = {p.name.removesuffix(SUFFIX): p.name for p in self.root.glob(f"*{SUFFIX}")}
        for p in self.root.glob(f"*/{FOLDER_WEIGHTS}"):
            found.setdefault(p.parent.name, f"{p.parent.name}/{FOLDER_WEIGHTS}")
        names = []
        for name, entry in sorted(found.items()):
            try:
                check_lora_name(name, "name")
            except InvalidArgument as exc:
                _warn_once(self.real, entry, "LoRA adapter file %s left out of the listing: %s", exc.description)
                continue
            names.append(name)
        return names

    def names(self) -> list[str]:
        """The names ``listing`` gives."""
        return [info.name for info in self.listing()]

    def find(self, name: str) -> AdapterInfo | None:
        """The adapter called ``name`` (a name already checked), its path resolved within the directory; None when
        there is none; AdapterError for a link leading outside or a sidecar that is not what the docs say."""
        path = self._weights(name)
        if path is None:
            return None
        try:
            size = path.stat().st_size
        except OSError:  # gone since the look-up
            return None
        sidecar = self._inside(self.root / f"{name}.json")
        if sidecar is None or not sidecar.is_file():
            return AdapterInfo(name, path, size_bytes=size)
        try:
            if sidecar.stat().st_size > SIDECAR_MAX_BYTES:
                raise AdapterError(f"has a sidecar {name}.json over {SIDECAR_MAX_BYTES} bytes")
            doc = json.loads(sidecar.read_bytes())
        except (OSError, ValueError) as exc:
            if isinstance(exc, AdapterError):
                raise
            raise AdapterError(f"has a sidecar {name}.json that is not JSON") from None
        doc = doc if isinstance(doc, dict) else {"scale": None}
        scale, description = doc.get("scale", 1.0), doc.get("description", "")
        if (not isinstance(scale, int | float) or isinstance(scale, bool) or not math.isfinite(scale)
                or abs(scale) > MAX_LORA_SCALE or not isinstance(description, str)):
            raise AdapterError(f"has a sidecar {name}.json that is not an object with a numeric \"scale\" in "
                               f"[{-MAX_LORA_SCALE:g}, {MAX_LORA_SCALE:g}] and a string \"description\"")
        return AdapterInfo(name, path, float(scale), description, size)

    def listing(self) -> list[AdapterInfo]:
        """Every adapter a job may name, by name, read afresh (names, stats and sidecars; never weights). One that
        fails its checks (a link leading outside, a bad sidecar) is left out, logged once: a job naming it is
        refused."""
        out = []
        for name in self._candidates():
            try:
                info = self.find(name)
            except AdapterError as exc:
                _warn_once(self.real, name, "LoRA adapter %s left out of the listing: it %s", str(exc))
                continue
            if info is not None:  # None: removed since the glob
                out.append(info)
        return out


# What was logged as left out, so a directory listed at every ListLoras logs each problem once per process; keyed by
# the reason too, so a file that goes wrong another way is logged again.
_warned: set[tuple[Path, str, str]] = set()


def _warn_once(root: Path, entry: str, message: str, why: str) -> None:
    key = (root, entry, why)
    if key not in _warned:
        _warned.add(key)
        log.warning(message, entry, why)


def linear_targets(transformer: torch.nn.Module) -> dict[str, tuple[int, int]]:
    """Every linear layer of the DiT an adapter may modify: name -> (in_features, out_features). The same with peft's
    layers already in place (their base layer stands for them)."""
    targets = {}
    for name, module in transformer.named_modules():
        if isinstance(module, torch.nn.Linear) and ".lora_" not in name:
            targets[name.removesuffix(".base_layer")] = (module.in_features, module.out_features)
    return targets


def _header(data: bytes) -> tuple[dict[str, Any], dict[str, str]]:
    """The tensors and the metadata of a safetensors file, every tensor's bytes within the file."""
    if len(data) < 8:
        raise AdapterError("is not a safetensors file (shorter than its header length)")
    (size,) = struct.unpack("<Q", data[:8])
    if size > len(data) - 8:
        raise AdapterError("is truncated or not a safetensors file (its header runs past the end)")
    try:
        header = json.loads(data[8:8 + size])
    except ValueError:
        raise AdapterError("is not a safetensors file (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise AdapterError("is not a safetensors file (its header is not an object)")
    metadata = header.pop("__metadata__", None) or {}
    body = len(data) - 8 - size
    for key, entry in header.items():
        try:
            dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
            count = math.prod(shape)
        except (KeyError, TypeError, ValueError):
            raise AdapterError(f"is not a safetensors file (entry {key!r})") from None
        if end > body:
            raise AdapterError(f"is truncated: {key} ends at byte {end} of a {body}-byte body")
        if dtype in _DTYPE_BYTES and end - begin != count * _DTYPE_BYTES[dtype]:
            raise AdapterError(f"is not a valid safetensors file ({key}: {end - begin} bytes for shape {shape})")
    return header, metadata if isinstance(metadata, dict) else {}


def _alpha_factor(metadata: Mapping[str, str], rank: int) -> float:
    """What the file's LoraConfig multiplies lora_B @ lora_A by (alpha / rank), 1 when it says nothing."""
    raw = metadata.get(_METADATA_KEY)
    if not raw:
        return 1.0
    try:
        config = json.loads(raw)
        config = {k.removeprefix(PREFIX): v for k, v in config.items()}
    except (ValueError, AttributeError):
        raise AdapterError(f"has {_METADATA_KEY} that is not a JSON object") from None
    if config.get("alpha_pattern") or config.get("use_dora") or config.get("lora_bias"):
        raise AdapterError("uses alpha_pattern, DoRA or LoRA biases, which this denoiser does not load")
    alpha = config.get("lora_alpha", rank)
    if not isinstance(alpha, int | float) or not math.isfinite(alpha) or alpha <= 0:
        raise AdapterError(f"has lora_alpha {alpha!r}; expected a positive number")
    return alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)


def read_adapter(path: Path, targets: Mapping[str, tuple[int, int]], limits: Limits
                 ) -> tuple[dict[str, torch.Tensor], int]:
    """The checked state dict of one adapter file (keys without the ``transformer.`` prefix, alpha folded in) and
    its largest rank; AdapterError saying what is wrong."""
    from safetensors.torch import load as load_safetensors

    # O_NOFOLLOW: ``path`` was resolved within the directory; a link put in its place since is refused (ELOOP), not
    # followed. Stat and read through the one descriptor, and never more than the limit and a byte.
    with os.fdopen(os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0)), "rb") as file:
        size = os.fstat(file.fileno()).st_size
        if size > limits.max_lora_bytes:
            raise AdapterError(f"is {size} bytes; the limit is {limits.max_lora_bytes} (--max-lora-bytes)")
        data = file.read(limits.max_lora_bytes + 1)
    if len(data) > limits.max_lora_bytes:  # grew since the stat
        raise AdapterError(f"is {len(data)} bytes; the limit is {limits.max_lora_bytes} (--max-lora-bytes)")
    header, metadata = _header(data)
    if not header:
        raise AdapterError("holds no tensors")
    prefixed = {key.startswith(PREFIX) for key in header}
    if len(prefixed) > 1:
        raise AdapterError(f"mixes keys under {PREFIX!r} with keys outside it")
    shapes: dict[str, dict[str, list[int]]] = {}
    for key, entry in header.items():
        bare = key.removeprefix(PREFIX)
        part = next((p for p in _PARTS if bare.endswith(p)), None)
        if part is None:
            raise AdapterError(f"has key {key!r}; expected only <module>.lora_A.weight and <module>.lora_B.weight")
        module = bare.removesuffix(part)
        if module not in targets:
            raise AdapterError(f"names {module!r}, which is not a linear layer of this DiT")
        if entry["dtype"] not in _DTYPE_BYTES or len(entry["shape"]) != 2:
            raise AdapterError(f"has {key} as {entry['dtype']} {entry['shape']}; expected a 2-D F16, BF16 or F32 "
                               "matrix")
        shapes.setdefault(module, {})[part[1:7]] = entry["shape"]
    ranks = []
    for module, pair in sorted(shapes.items()):
        if set(pair) != {"lora_A", "lora_B"}:
            raise AdapterError(f"has only {', '.join(pair)} for {module}; a LoRA needs lora_A and lora_B")
        (rank, fan_in), (fan_out, rank_b) = pair["lora_A"], pair["lora_B"]
        want_in, want_out = targets[module]
        if rank != rank_b or (fan_in, fan_out) != (want_in, want_out) or rank < 1:
            raise AdapterError(f"has {module} lora_A {pair['lora_A']} and lora_B {pair['lora_B']}; this DiT needs "
                               f"[r, {want_in}] and [{want_out}, r]")
        if rank > limits.max_lora_rank:
            raise AdapterError(f"has rank {rank} at {module}; the limit is {limits.max_lora_rank} (--max-lora-rank)")
        ranks.append(rank)
    try:
        tensors = load_safetensors(data)
    except Exception:  # safetensors' own checks (overlapping or unordered data) beyond the header's
        raise AdapterError("is not a valid safetensors file") from None
    state = {}
    # Sorted so a lora_A key comes first: diffusers reads the first key to tell peft's layout from older ones.
    for key in sorted(tensors, key=lambda k: k.removeprefix(PREFIX)):
        bare = key.removeprefix(PREFIX)
        tensor = tensors[key]
        if bare.endswith(".lora_B.weight"):
            tensor = tensor * _alpha_factor(metadata, tensor.shape[1])
        state[bare] = tensor
    return state, max(ranks)


@dataclass(frozen=True)
class Loaded:
    name: str
    adapter: str  # peft's adapter name: unique per load, so a reloaded file never meets its old layers
    signature: tuple[int, int]  # the file's mtime and size when loaded: a replaced file is loaded again
    rank: int


class AdapterCache:
    """The adapters loaded in one transformer, at most ``capacity``, the least recently used evicted first."""

    def __init__(self, transformer: torch.nn.Module, directory: AdapterDirectory, limits: Limits,
                 capacity: int) -> None:
        if capacity < 1:
            raise ValueError("--max-loaded-loras must be at least 1")
        self.transformer = transformer
        self.directory = directory
        self.limits = limits
        self.capacity = capacity
        self.targets = linear_targets(transformer)
        self._lru: OrderedDict[str, Loaded] = OrderedDict()
        self._ids = itertools.count()
        # What loaded() answers, replaced whole at every change: other threads (ListLoras on the event loop) read it
        # while the worker thread edits the LRU.
        self._names: tuple[str, ...] = ()

    def loaded(self) -> tuple[str, ...]:
        """Names loaded, least recently used first (any thread)."""
        return self._names

    def resolve(self, refs: Sequence[LoraRef]) -> tuple[LoraRef, ...]:
        """Check a job's adapters and fill each default scale: InvalidArgument naming ``loras`` or ``loras[i]``.
        Reads only names and sidecars (cheap enough for the caller's thread); files are checked when loaded."""
        check_loras(refs, self.limits)
        out = []
        for i, ref in enumerate(refs):
            info = self._find(ref.name, f"loras[{i}]", f"loras[{i}].name")
            out.append(LoraRef(ref.name, info.default_scale if ref.scale is None else ref.scale))
        return tuple(out)

    def check_names(self, names: Sequence[str]) -> None:
        """Check a LoadLoras request's names (how many, each one's form, each in the directory): InvalidArgument
        naming ``names`` or ``names[i]``. Reads only names and sidecars, like ``resolve``."""
        check_lora_names(names, self.limits)
        for i, name in enumerate(names):
            self._find(name, f"names[{i}]", f"names[{i}]")

    def _find(self, name: str, field: str, unknown_field: str) -> AdapterInfo:
        try:
            info = self.directory.find(name)
        except AdapterError as exc:
            raise InvalidArgument(field, f"adapter {name!r} {exc}") from None
        if info is None:
            raise InvalidArgument(unknown_field, f"no adapter {name!r} on this denoiser")
        return info

    def activate(self, refs: Sequence[LoraRef]) -> float:
        """Make the transformer run exactly ``refs`` (resolved) for the next job, loading what is missing; the
        seconds spent loading files (0 when all were loaded)."""
        active = [(i, ref) for i, ref in enumerate(refs) if ref.scale]
        if not active:
            base_only(self.transformer)
            return 0.0
        adapters, seconds = self._ensure([(ref.name, f"loras[{i}]", f"loras[{i}].name") for i, ref in active])
        self.transformer.enable_lora()
        self.transformer.set_adapters(adapters, weights=[float(ref.scale) for _, ref in active])
        return seconds

    def preload(self, names: Sequence[str]) -> tuple[str, ...]:
        """LoadLoras: load ``names`` (checked by check_names) ahead of the jobs that name them, counted as a job's
        would be; what is loaded afterwards. Leaves the transformer's active adapters to the next job's activate."""
        self._ensure([(name, f"names[{i}]", f"names[{i}]") for i, name in enumerate(names)])
        return self._names

    def unload(self, names: Sequence[str]) -> tuple[str, ...]:
        """UnloadLoras: drop those of ``names`` that are loaded (the others are not an error); what stays loaded."""
        for name in names:
            if name in self._lru:
                self._evict(name)
        return self._names

    def _ensure(self, wanted: Sequence[tuple[str, str, str]]) -> tuple[list[str], float]:
        """Peft's adapter names for ``wanted`` (name, field naming it, field naming it when unknown), each loaded and
        now the most recently used, and the seconds spent loading files. Every file missing is read and checked
        before any touches the model, so a bad one (InvalidArgument naming its field) leaves nothing half-loaded."""
        hits: dict[str, str] = {}
        pending: list[tuple[str, str, AdapterInfo, tuple[int, int], dict[str, torch.Tensor], int]] = []
        started: float | None = None
        for name, field, unknown_field in wanted:
            info = self._find(name, field, unknown_field)  # again: the file may have gone since validation
            try:
                signature = _signature(info.path)
            except OSError:
                raise InvalidArgument(unknown_field, f"no adapter {name!r} on this denoiser") from None
            entry = self._lru.get(name)
            if entry is not None and entry.signature == signature:
                metrics.LORA_HITS.inc()
                hits[name] = entry.adapter
                continue
            metrics.LORA_MISSES.inc()
            started = time.perf_counter() if started is None else started
            if entry is not None:  # the file was replaced: its old layers go
                self._evict(name)
            try:
                state, rank = read_adapter(info.path, self.targets, self.limits)
            except (AdapterError, OSError) as exc:
                why = str(exc) if isinstance(exc, AdapterError) else "cannot be read"
                log.warning("refused LoRA adapter %s (%s): %s", name, info.path, why)
                raise InvalidArgument(field, f"adapter {name!r} {why}") from None
            pending.append((name, field, info, signature, state, rank))
        keep = {name for name, _, _ in wanted}
        added: list[str] = []
        try:
            for name, field, info, signature, state, rank in pending:
                self._load(name, field, info, signature, state, rank, keep)
                added.append(name)
        except InvalidArgument:
            for name in added:  # all or nothing
                self._evict(name)
            raise
        for name, _, _ in wanted:  # the order named: the last one the most recently used
            self._lru.move_to_end(name)
        self._changed()
        adapters = [hits[name] if name in hits else self._lru[name].adapter for name, _, _ in wanted]
        return adapters, 0.0 if started is None else time.perf_counter() - started

    def _load(self, name: str, field: str, info: AdapterInfo, signature: tuple[int, int],
              state: dict[str, torch.Tensor], rank: int, keep: set[str]) -> None:
        while len(self._lru) >= self.capacity:  # a request names at most capacity adapters: one not kept is here
            self._evict(next(n for n in self._lru if n not in keep))
        loaded = Loaded(name, f"lora{next(self._ids)}", signature, rank)
        try:
            with warnings.catch_warnings():  # peft warns on every adapter after the first: several are the point
                warnings.filterwarnings("ignore", message="Already found a `peft_config`")
                self.transformer.load_lora_adapter(state, prefix=None, adapter_name=loaded.adapter)
        except Exception:
            log.exception("loading LoRA adapter %s failed", name)
            if loaded.adapter in (getattr(self.transformer, "peft_config", None) or {}):
                self.transformer.delete_adapters(loaded.adapter)
            raise InvalidArgument(field, f"adapter {name!r} could not be loaded into this DiT") from None
        self._lru[name] = loaded
        self._changed()
        metrics.LORA_LOADS.inc()
        log.info("loaded LoRA adapter %s (rank %d) from %s", name, rank, info.path)

    def _evict(self, name: str) -> None:
        entry = self._lru.pop(name)
        with warnings.catch_warnings():  # the next job sets its own adapters: which one peft activates is moot
            warnings.filterwarnings("ignore", message="Adapter .* was active which is now deleted")
            self.transformer.delete_adapters(entry.adapter)
        self._changed()
        metrics.LORA_EVICTIONS.inc()
        log.info("evicted LoRA adapter %s", name)

    def _changed(self) -> None:
        self._names = tuple(self._lru)
        metrics.LORAS_LOADED.set(len(self._names))


def base_only(transformer: torch.nn.Module) -> None:
    """The base model for the next job: LoRA layers, if any were ever added, call only their base layer."""
    if getattr(transformer, "peft_config", None):
        transformer.disable_lora()

