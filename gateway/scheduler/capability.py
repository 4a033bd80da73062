"""Capability placement: which denoisers may run a job, in a pool whose members differ (a rolling upgrade, an adapter
directory on some of them, a lower --max-pixels on one).

Each denoiser's capabilities come in as WorkerCapabilities, each request's needs with RequestArrived; both are
opaque here, and whether a job fits a worker is the driver's ``fits`` (runtime.capability.fits: the one
rule admission applies too). The scheduler calls it once per request and kind of denoiser (the answers are kept
on the request), and only while the pool holds a kind that some active request does not fit (``restricted``):
until then every job goes anywhere, on the plain path, as in a uniform pool.

A restricted job goes only to a denoiser that fits it (placement.Placement.dispatch, the pass that runs while one
is active); when the only ones that fit are busy it waits for one, and the jobs behind it go on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from .pool import Worker
from .records import Request
from .speed import DENOISER

Fits = Callable[[object, object], bool]


class Capability:
    """The kinds of denoiser in the pool, and how many active requests some kind of them cannot run."""

    __slots__ = ("fits", "kinds", "restricted")

    def __init__(self, fits: Fits | None) -> None:
        self.fits = fits  # None: every job fits every worker (no capabilities are followed)
        self.kinds: dict[object, int] = {}  # a denoiser member's capabilities -> how many members have them
        self.restricted = 0  # active requests with Request.restricted set

    def can_run(self, req: Request, w: Worker) -> bool:
        """Whether denoiser ``w`` can run ``req``'s jobs (asked once per request and kind, then remembered)."""
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
        """A request just became active: restricted if some kind of denoiser in the pool cannot run it."""
        if req.needs is not None and self.fits is not None and self.kinds:
            req.restricted = not all(self._fits_kind(req, caps) for caps in self.kinds)
            self.restricted += req.restricted

    def end(self, req: Request) -> None:
        if req.restricted:
            req.restricted = False
            self.restricted -= 1

    def set(self, w: Worker, caps: object, active: Iterable[Request]) -> None:
        """What ``w`` can run now (None: not known, or it left the pool). When the kinds in the pool change, every
        active request is looked at again (rare: a member joins, leaves or is restarted with other flags)."""
        if caps == w.caps:
            return
        old, w.caps = w.caps, caps
        if w.role is not DENOISER:
            return
        changed = False
        if old is not None:
            left = self.kinds[old] - 1
            if left:
                self.kinds[old] = left
            else:
                del self.kinds[old]
                changed = True
        if caps is not None:
            changed = changed or caps not in self.kinds
            self.kinds[caps] = self.kinds.get(caps, 0) + 1
        if changed:
            for req in active:
                self.end(req)
                self.admit(req)
