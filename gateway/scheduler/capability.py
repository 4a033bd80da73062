"""Capability placement: which workers may run a request, in a pool whose members differ (a rolling upgrade, an
adapter directory on some denoisers, a lower --max-pixels on one denoiser or one AR server).

Each worker's capabilities come in as WorkerCapabilities, each request's needs with RequestArrived; both are
opaque here, and whether a request fits a worker is the driver's ``fits`` (runtime.capability.fits: the one rule
admission applies too). The scheduler calls it once per request and kind of worker (the answers are kept on the
request), and only while the pool holds a kind of that stage that some active request does not fit
(``restricted``, ``ar_restricted``): until then every job and every batch goes anywhere, on the plain paths, as in
a uniform pool.

A restricted job goes only to a denoiser that fits it (placement.Placement.dispatch, the pass that runs while one
is active); an AR batch, only to an AR server that fits every request in it (``Capability.dispatch_ar``). When the
only ones that fit are busy, the job or the request waits for one (until its deadline, as a denoise job waits for
a capable denoiser that left: one that comes back, or joins, runs it), and the work behind it goes on.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable

from .containers import ArQueue
from .fairness import Shares
from .pool import Pool, Worker
from .records import Request
from .speed import AR, NEVER
from .types import Action, SchedulerConfig

Fits = Callable[[object, object], bool]
GroupKey = tuple[int, int, int]
StartBatch = Callable[[Worker, GroupKey, list[Request], list[Action]], None]


class Capability:
    """The kinds of worker of each stage in the pool, and how many active requests some kind of them cannot run."""

    __slots__ = ("fits", "kinds", "restricted", "ar_kinds", "ar_restricted")

    def __init__(self, fits: Fits | None) -> None:
        self.fits = fits  # None: every request fits every worker (no capabilities are followed)
        self.kinds: dict[object, int] = {}  # a denoiser member's capabilities -> how many members have them
        self.restricted = 0  # active requests with Request.restricted set
        self.ar_kinds: dict[object, int] = {}  # the same for the AR servers
        self.ar_restricted = 0  # active requests with Request.ar_restricted set

    def can_run(self, req: Request, w: Worker) -> bool:
        """Whether worker ``w`` can run ``req`` (asked once per request and kind, then remembered)."""
        caps = w.caps
        return req.needs is None or caps is None or self.fits is None or self._fits_kind(req, caps)

    def _fits_kind(self, req: Request, caps: object) -> bool:
        fit = req.fit
        if fit is None:
            fit = req.fit = {}
        got = fit.get(caps)
        if got is None:
            assert self.fits is not None
            got = fit[caps] = self.fits(req.needs, caps)
        return got

    def admit(self, req: Request) -> None:
        """A request just became active: restricted (per stage) if some kind of that stage cannot run it."""
        if req.needs is not None and self.fits is not None:
            if self.kinds:
                req.restricted = not all(self._fits_kind(req, caps) for caps in self.kinds)
                self.restricted += req.restricted
            if self.ar_kinds:
                req.ar_restricted = not all(self._fits_kind(req, caps) for caps in self.ar_kinds)
                self.ar_restricted += req.ar_restricted

    def end(self, req: Request) -> None:
        if req.restricted:
            req.restricted = False
            self.restricted -= 1
        if req.ar_restricted:
            req.ar_restricted = False
            self.ar_restricted -= 1

    def set(self, w: Worker, caps: object, active: Iterable[Request]) -> None:
        """What ``w`` can run now (None: not known, or it left the pool). When the kinds in the pool change, every
        active request is looked at again (rare: a member joins, leaves or is restarted with other flags)."""
        if caps == w.caps:
            return
        old, w.caps = w.caps, caps
        kinds = self.ar_kinds if w.role is AR else self.kinds
        changed = False
        if old is not None:
            left = kinds[old] - 1
            if left:
                kinds[old] = left
            else:
                del kinds[old]
                changed = True
        if caps is not None:
            changed = changed or caps not in kinds
            kinds[caps] = kinds.get(caps, 0) + 1
        if changed:
            for req in active:
                self.end(req)
                self.admit(req)

    def dispatch_ar(self, groups: dict[GroupKey, ArQueue], pool: Pool, shares: Shares, cfg: SchedulerConfig,
                    now: float, start_batch: StartBatch, actions: list[Action]) -> float:
        """The AR pass while some active request cannot run on every kind of AR server (core's plain pass runs
        otherwise). Each free AR server sees the queues as a uniform pool of its kind would: only the requests it
        can run (its view), grouped, aged and shared out by the same rules (fairness.Shares.ar_group and ar_batch),
        so a batch holds only requests its server fits; a request whose capable servers are busy waits in its queue
        while the others go on. The server that can run the fewest waiting requests chooses first (a server that
        runs anything keeps its room for what only it can run), then the plain pass's order (Pool.free_ar_servers).
        A batch at a time, until no free server's view holds a group that may leave: the time returned is when the
        clock alone lets one leave (NEVER: only an event will), as the plain pass's _ar_recheck_at."""
        cap = cfg.ar_batch_max_outputs
        while True:
            recheck = NEVER
            views: list[tuple[int, int, Worker, dict[GroupKey, ArQueue]]] = []
            for order, w in enumerate(pool.free_ar_servers()):
                view: dict[GroupKey, ArQueue] = {}
                reach = 0
                for key, q in groups.items():
                    mine = deque(r for r in q.requests if self.can_run(r, w))
                    if mine:
                        view[key] = sub = ArQueue()
                        sub.keep_only(mine)
                        reach += len(mine)
                if view:
                    views.append((reach, order, w, view))
            views.sort(key=lambda v: v[:2])
            for _, _, w, view in views:
                key, wait_until = shares.ar_group(view, cfg, now)
                if key is not None:
                    start_batch(w, key, shares.ar_batch(view[key].requests, cap), actions)
                    break
                recheck = min(recheck, wait_until)
            else:
                return recheck
