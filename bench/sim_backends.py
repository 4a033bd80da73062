"""Simulated AR and denoiser gRPC servers: real servers (runtime.server plumbing, health, reflection)
whose work is a sleep from a cost model. For benchmarks of the scheduler and for gateway tests that need
precise control over timing; they hold no model and produce no real image.

Cost model (reference figures of the 16-NPU deployment, DESIGN.md section 2), multiplied by ``scale``:
- AR batch of b outputs at 1024x1024: 20.4, 21.3, 22.8, 25.9, 29.4, 33.2 s for b = 1, 2, 4, 8, 16, 32, linear in
  between (and flat beyond 32). A simulated AR server runs one model batch at a time, like one engine, and merges
  calls like the real AR server (services.ar.batcher.CallMerger, `--merge-window-ms`): the calls of one resolution
  waiting when a batch starts, and those arriving within ``merge_window`` after it starts, run as one batch while
  they fit in ``cap`` outputs; the batch costs the model time of the merged size. The window is counted inside
  the batch's own time (a call alone takes exactly its cost, as before merging existed): the real window is 2 ms
  next to a 20-33 s batch, while in the simulation a 2 ms wait would be 100x too large in reference time.
- Denoise: 12.2 s per image, batch 1 (a busy simulated denoiser refuses a second job, like the real one).

`python -m bench.sim_backends --denoisers 14 --scale 0.01 --ready-file FILE` serves a simulated cluster
(`--ar N` AR servers, `--merge-window-ms`, `--ar-batch-cap`, `--ar-stagger` to run several out of phase,
`--stats-file` for what the workers saw).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from glmimage.v1 import (
    ar_service_pb2,
    ar_service_pb2_grpc,
    common_pb2,
    denoiser_service_pb2,
    denoiser_service_pb2_grpc,
)
from runtime.errors import DENOISER_BUSY, InvalidArgument, ResourceExhausted
from runtime.logs import configure_logging
from runtime.server import GrpcServer, install_shutdown_signals, start_server
from runtime.tls import ServerTls
from services.denoiser.occupancy import OccupancyBoard

log = logging.getLogger(__name__)

AR_BATCH_SECONDS: tuple[tuple[int, float], ...] = ((1, 20.4), (2, 21.3), (4, 22.8), (8, 25.9), (16, 29.4),
                                                   (32, 33.2))
DENOISE_SECONDS = 12.2
AR_MERGE_WINDOW = 0.002  # seconds, the real AR server's --merge-window-ms default
AR_MERGE_CAP = 32  # outputs: the last point of the cost table
AR_SERVICE = "glmimage.v1.ArService"
DENOISER_SERVICE = "glmimage.v1.DenoiserService"


def ar_batch_seconds(outputs: int, table: Sequence[tuple[int, float]] = AR_BATCH_SECONDS) -> float:
    """Reference AR batch time (unscaled) for a batch of ``outputs`` output slots, linear between the points."""
    if outputs <= table[0][0]:
        return table[0][1]
    for (b0, t0), (b1, t1) in zip(table, table[1:], strict=False):
        if outputs <= b1:
            return t0 + (t1 - t0) * (outputs - b0) / (b1 - b0)
    return table[-1][1]


def tiny_png(width: int = 8, height: int = 8, shade: int = 128) -> bytes:
    """A valid grey PNG, built by hand so the simulation needs no imaging library."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    rows = b"".join(b"\x00" + bytes([shade]) * width for _ in range(height))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))


@dataclass(frozen=True)
class SimCosts:
    scale: float = 0.01  # 0.01: the reference figures scaled down 100x
    denoise_seconds: float = DENOISE_SECONDS

    def ar(self, outputs: int) -> float:
        return ar_batch_seconds(outputs) * self.scale

    def denoise(self) -> float:
        return self.denoise_seconds * self.scale


@dataclass(eq=False)
class _ArCall:
    """One Generate/GenerateBatch call waiting for, or running in, a simulated model batch."""

    outputs: int
    key: tuple[int, int] | None  # calls of one key may share a batch; None (an edit): never merged
    done: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class SimAr(ar_service_pb2_grpc.ArServiceServicer):
    """Simulated AR server: one model batch at a time, merging concurrent calls, sleeping the cost model's time."""

    def __init__(self, costs: SimCosts = SimCosts(), cached_tokens: int = 0, tokens_per_output: int = 16, *,
                 merge_window: float = AR_MERGE_WINDOW, cap: int = AR_MERGE_CAP, phase: float = 0.0) -> None:
        """phase: seconds the engine stays busy after the first call arrives, as if ending a batch from before it
        (identical simulated servers that get their first calls at once otherwise run in lockstep for good, every
        one returning its batches at the same instant, since their costs do not vary)."""
        self.costs = costs
        self.cached_tokens = cached_tokens  # reported per output, as a prefix-caching AR would
        self.tokens_per_output = tokens_per_output
        self.merge_window = merge_window  # seconds after a batch starts in which a call may still join it
        self.cap = cap  # the most outputs one merged batch holds (a single larger call still runs, alone)
        self.phase = phase
        self._waiting: list[_ArCall] = []  # in arrival order (FIFO, like the real admission queue)
        self._arrived = asyncio.Event()
        self._engine: asyncio.Task | None = None
        self.batches: list[int] = []  # output slots of each batch run, in order
        self.started: list[float] = []  # loop time each of them started
        self.calls = 0  # calls that ran (alone or merged)
        self.merged_calls = 0  # of those, calls that joined a batch another call started
        self.window_open = asyncio.Event()  # set while a batch's merge window is open: a test's call can join it

    def _response(self, r: ar_service_pb2.GenerateRequest) -> ar_service_pb2.GenerateResponse:
        if not r.prompt.strip():
            raise InvalidArgument("prompt", "must not be empty")
        n, seed = r.n or 1, r.seed if r.HasField("seed") else 0
        prompt_tokens = len(r.prompt.split()) + 8  # a stand-in for the chat template
        usage = common_pb2.Usage(prompt_tokens=prompt_tokens, completion_tokens=self.tokens_per_output + 1,
                                 total_tokens=prompt_tokens + self.tokens_per_output + 1,
                                 cached_tokens=min(self.cached_tokens, prompt_tokens))
        outputs = [ar_service_pb2.PriorOutput(
            tokens=common_pb2.TokenRow(token_ids=list(range(self.tokens_per_output))), seed=seed + i, usage=usage)
            for i in range(n)]
        return ar_service_pb2.GenerateResponse(outputs=outputs, height=r.height, width=r.width)

    async def _run(self, requests: Sequence[ar_service_pb2.GenerateRequest]) -> list[ar_service_pb2.GenerateResponse]:
        responses = [self._response(r) for r in requests]
        sizes = {(r.height, r.width) for r in requests}
        key = None if len(sizes) != 1 or any(r.reference_images for r in requests) else sizes.pop()
        call = _ArCall(sum(len(r.outputs) for r in responses), key)
        self._waiting.append(call)
        self._arrived.set()
        if self._engine is None or self._engine.done():
            self._engine = asyncio.ensure_future(self._engine_loop())
        await call.done  # a caller that goes away cancels it: it leaves the queue, or its rows leave the batch
        return responses

    def _claim(self, batch: list[_ArCall], rows: int) -> int:
        """Move waiting calls of the batch's key into it while they fit; returns the rows it holds."""
        key = batch[0].key
        if key is None:
            return rows
        for call in list(self._waiting):
            if call.key == key and not call.done.done() and rows + call.outputs <= self.cap:
                self._waiting.remove(call)
                batch.append(call)
                rows += call.outputs
        return rows

    async def _engine_loop(self) -> None:
        """Run batches while calls wait: the first waiting call leads, the others join while they fit."""
        loop = asyncio.get_running_loop()
        if self.phase > 0:
            phase, self.phase = self.phase, 0.0
            await asyncio.sleep(phase)
        while True:
            self._waiting = [c for c in self._waiting if not c.done.done()]
            if not self._waiting:
                return
            t0 = loop.time()
            batch = [self._waiting.pop(0)]
            rows, close = batch[0].outputs, t0 + self.merge_window
            self.window_open.set()
            while (rows := self._claim(batch, rows)) < self.cap and (left := close - loop.time()) > 0:
                self._arrived.clear()
                try:
                    await asyncio.wait_for(self._arrived.wait(), left)
                except TimeoutError:
                    pass
            self.window_open.clear()
            live = [c for c in batch if not c.done.done()]
            if not live:
                continue
            rows = sum(c.outputs for c in live)
            self.batches.append(rows)
            self.started.append(t0)
            self.calls += len(live)
            self.merged_calls += len(live) - 1
            left = t0 + self.costs.ar(rows) - loop.time()
            if left > 0:  # ends early only when every call in it is gone, like the real engine
                await asyncio.wait([c.done for c in live], timeout=left)
            for c in live:
                if not c.done.done():
                    c.done.set_result(None)

    async def Generate(self, request, context: grpc.aio.ServicerContext):
        (response,) = await self._run([request])
        return response

    async def GenerateBatch(self, request, context: grpc.aio.ServicerContext):
        if not request.requests:
            raise InvalidArgument("requests", "must not be empty")
        return ar_service_pb2.GenerateBatchResponse(responses=await self._run(request.requests))


class SimDenoiser(denoiser_service_pb2_grpc.DenoiserServiceServicer):
    """Simulated batch-1 denoiser: sleeps the cost model's time, spread over the steps of the job.

    ``gate``, when given, holds every job of two steps or more after its first step until the event is set, so
    a test can look at a gateway while it is sure where each job is."""

    def __init__(self, costs: SimCosts = SimCosts(), default_steps: int = 4, gate: asyncio.Event | None = None,
                 image: bytes | None = None) -> None:
        self.costs = costs
        self.default_steps = default_steps
        self.gate = gate
        self.image = image or tiny_png()
        self.busy = False
        self.running = asyncio.Event()  # set while a job holds the slot
        self.jobs: list[str] = []  # x-request-id of every job accepted, in order
        self.completed = 0
        self.cancelled = 0
        self.refused_busy = 0
        self.holding = self.max_holding = 0  # jobs holding the slot now / at most at once (1: never two)
        self.taken_at = self.freed_at = 0.0  # loop time the current job took the slot / the last one freed it
        # Per busy refusal: seconds since the job holding the slot took it, and how long the slot had been free
        # before that (near 0: the holder took a denoiser just freed, so the refused gateway raced it for it).
        self.refused_after: list[tuple[float, float, float | None]] = []
        # Per gateway connection (its channel's peer, shared by its calls and its occupancy stream): the last state
        # written to its stream, and when. At a refusal: was the state that refuses it already sent there?
        self.delivered: dict[str, tuple[int, float]] = {}
        self.occupancy = OccupancyBoard()  # published like the real denoiser's, for several gateways

    async def WatchOccupancy(self, request, context: grpc.aio.ServicerContext):
        peer = context.peer()
        async for message in self.occupancy.messages():
            yield message
            self.delivered[peer] = (message.sequence, asyncio.get_running_loop().time())

    async def _steps(self, request: denoiser_service_pb2.DenoiseRequest, partial_images: int,
                     context: grpc.aio.ServicerContext):
        """Yield (step, total, partial index or None) as the job advances; owns the slot while it runs."""
        if not request.prior_tokens.token_ids:
            raise InvalidArgument("prior_tokens", "must not be empty")
        if self.busy:
            self.refused_busy += 1
            held = self.occupancy.state
            now = asyncio.get_running_loop().time()
            seq, at = self.delivered.get(context.peer(), (None, 0.0))
            self.refused_after.append((now - self.taken_at, self.taken_at - self.freed_at,
                                       now - at if seq == held.sequence else None))
            raise ResourceExhausted("busy: this denoiser runs one job at a time", reason=DENOISER_BUSY,
                                    info={"owner": held.owner, "sequence": str(held.sequence)})
        total = request.num_inference_steps or self.default_steps
        previews = {max(1, (j + 1) * total // (partial_images + 1)): j for j in range(partial_images)}
        self.busy = True
        self.taken_at = asyncio.get_running_loop().time()
        self.holding += 1
        self.max_holding = max(self.max_holding, self.holding)
        self.occupancy.take(request.owner, request.request_id)
        self.running.set()
        rid = dict(context.invocation_metadata()).get("x-request-id", "")
        self.jobs.append(rid if isinstance(rid, str) else rid.decode())
        per_step = self.costs.denoise() / total
        try:
            for step in range(1, total + 1):
                await asyncio.sleep(per_step)
                yield step, total, previews.get(step)
                if step == 1 and step < total and self.gate is not None:
                    await self.gate.wait()  # after the first step is out, so a stream shows it
            self.completed += 1
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.busy = False
            self.holding -= 1
            self.occupancy.release()
            self.freed_at = asyncio.get_running_loop().time()
            self.running.clear()

    def _result(self, request: denoiser_service_pb2.DenoiseRequest, steps: int) -> denoiser_service_pb2.DenoiseResponse:
        return denoiser_service_pb2.DenoiseResponse(
            image=self.image, output_format=request.output_format or common_pb2.IMAGE_FORMAT_PNG,
            height=request.height, width=request.width, steps_completed=steps, seed=request.seed)

    async def Denoise(self, request, context: grpc.aio.ServicerContext):
        done = 0
        async for step, _, _ in self._steps(request, 0, context):
            done = step
        return self._result(request, done)

    async def DenoiseStream(self, request, context: grpc.aio.ServicerContext):
        steps = 0
        async for steps, total, preview in self._steps(request.job, request.partial_images, context):
            yield denoiser_service_pb2.DenoiseStreamResponse(
                progress=denoiser_service_pb2.DenoiseProgress(step=steps, total_steps=total))
            if preview is not None:
                yield denoiser_service_pb2.DenoiseStreamResponse(partial_image=denoiser_service_pb2.PartialImage(
                    partial_image_index=preview, step=steps, image=tiny_png(shade=40 * (preview + 1))))
        yield denoiser_service_pb2.DenoiseStreamResponse(result=self._result(request.job, steps))


async def serve_sim_ar(servicer: SimAr, host: str = "127.0.0.1", port: int = 0,
                       tls: ServerTls | None = None) -> GrpcServer:
    server = await start_server(lambda s: ar_service_pb2_grpc.add_ArServiceServicer_to_server(servicer, s),
                                [AR_SERVICE], f"{host}:{port}", tls=tls)
    server.servicer = servicer
    await server.set_serving(True)
    return server


async def serve_sim_denoiser(servicer: SimDenoiser, host: str = "127.0.0.1", port: int = 0,
                             tls: ServerTls | None = None) -> GrpcServer:
    server = await start_server(
        lambda s: denoiser_service_pb2_grpc.add_DenoiserServiceServicer_to_server(servicer, s),
        [DENOISER_SERVICE], f"{host}:{port}", tls=tls)
    server.servicer = servicer
    await server.set_serving(True)
    return server


async def _main(args: argparse.Namespace) -> None:
    costs = SimCosts(scale=args.scale)
    # --ar-stagger: server k of N starts k/N of a full batch's time late, so the servers run out of phase.
    ars = [await serve_sim_ar(SimAr(costs, merge_window=args.merge_window_ms / 1000, cap=args.ar_batch_cap,
                                    phase=costs.ar(args.ar_batch_cap) * k / args.ar if args.ar_stagger else 0.0),
                              args.host) for k in range(args.ar)]
    dns = [await serve_sim_denoiser(SimDenoiser(costs, default_steps=args.steps), args.host)
           for _ in range(args.denoisers)]
    addresses = {"ar": [f"{args.host}:{s.port}" for s in ars], "denoisers": [f"{args.host}:{s.port}" for s in dns]}
    stop = install_shutdown_signals()
    lag = asyncio.ensure_future(_loop_lag(lags := [])) if args.stats_file else None
    if args.ready_file:
        tmp = args.ready_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(addresses))
        tmp.replace(args.ready_file)
    log.info("simulated cluster up: %d AR, %d denoisers, scale %g", len(ars), len(dns), args.scale)
    await stop.wait()
    for server in (*ars, *dns):
        await server.stop(None)
    if lag is not None:
        lag.cancel()
        write_stats(args.stats_file, [s.servicer for s in ars], [s.servicer for s in dns], lags)


async def _loop_lag(out: list[float], every: float = 0.01) -> None:
    """How late this process's event loop wakes a 10 ms sleep: how long any message waits to be handled here."""
    loop = asyncio.get_running_loop()
    while True:
        t0 = loop.time()
        await asyncio.sleep(every)
        out.append(loop.time() - t0 - every)


def write_stats(path: Path, ars: Sequence[SimAr], dns: Sequence[SimDenoiser], lags: Sequence[float] = ()) -> None:
    """What the simulated workers saw, for a benchmark to read once they have stopped."""
    stats = {"ar": [{"batches": len(a.batches), "outputs": sum(a.batches), "calls": a.calls,
                     "merged_calls": a.merged_calls, "started": a.started} for a in ars],
             "denoisers": {"completed": sum(d.completed for d in dns), "cancelled": sum(d.cancelled for d in dns),
                           "refused_busy": sum(d.refused_busy for d in dns),
                           # Wall seconds since the holder took the slot, per refusal: a few ms is a race for a
                           # denoiser just freed; more is a gateway acting on a view its stream had not updated.
                           "refused_after_s": [t for d in dns for t in d.refused_after],
                           "max_holding": max((d.max_holding for d in dns), default=0)}}
    stats["loop_lag_s"] = sorted(lags)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(stats))
    tmp.replace(path)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Simulated AR and denoiser servers (cost model, no model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--ar", type=int, default=1, help="simulated AR servers")
    p.add_argument("--denoisers", type=int, default=14)
    p.add_argument("--scale", type=float, default=0.01, help="multiplier on the reference times")
    p.add_argument("--steps", type=int, default=1,
                   help="denoise steps when a request gives none (the job's time is split over its steps)")
    p.add_argument("--merge-window-ms", type=float, default=AR_MERGE_WINDOW * 1000,
                   help="a simulated AR batch takes in calls arriving this long after it starts (within its time)")
    p.add_argument("--ar-batch-cap", type=int, default=AR_MERGE_CAP,
                   help="the most outputs a merged simulated AR batch holds")
    p.add_argument("--ar-stagger", action="store_true",
                   help="AR server k of N holds its first batch k/N of a full batch's time, so the servers run out "
                        "of phase (identical servers started at once stay in lockstep)")
    p.add_argument("--ready-file", type=Path, default=None, help="write {ar: [...], denoisers: [...]} here")
    p.add_argument("--stats-file", type=Path, default=None,
                   help="on shutdown, write what the workers saw (AR batches and merges, denoise jobs) here")
    p.add_argument("--log-level", default="WARNING")
    args = p.parse_args(argv)
    configure_logging(args.log_level)
    asyncio.run(_main(args))


if __name__ == "__main__":
    main()
