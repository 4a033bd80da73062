"""The gateway's pool as its driver holds it: each member (a gateway.workers.Worker) by address, which members are
removed and draining, and what the members can run together: the limits in force, the distinct kinds of member per
stage, and the LoRA catalogue, each recomputed after any change of members or of what one says it can run.

The driver decides when a member comes or goes and tells the scheduler; this module only answers what the pool is,
for admission (GetLimits, a request's fit), GetStatus and the adapter calls.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping

from gateway.scheduler.types import WorkerRole
from gateway.workers import Platform, Worker, WorkerHealth
from glmimage.v1 import common_pb2
from runtime.capability import Capabilities, Needs, refusal
from runtime.errors import InvalidArgument
from runtime.limits import Limits, limits_in_force


class Members:
    def __init__(self, own_limits: Mapping[str, int]) -> None:
        self._own_limits = dict(own_limits)  # the gateway's own flags: nothing in force goes past them
        self._workers: dict[str, Worker] = {}
        self._removed: set[str] = set()  # removed from the scheduler, maybe still draining
        self._limits: Limits | None = None
        self._loras: dict[str, common_pb2.LoraInfo] | None = None
        self._kinds: dict[WorkerRole, list[Capabilities]] | None = None  # per role, in the order they joined

    # ---- who is a member ---------------------------------------------------------------------------------------

    def get(self, address: str) -> Worker | None:
        return self._workers.get(address)

    def all(self) -> Iterable[Worker]:
        """Every member held, draining ones included."""
        return self._workers.values()

    def __len__(self) -> int:
        """Members held, both roles, draining ones included (what --max-workers bounds)."""
        return len(self._workers)

    def role(self, address: str) -> WorkerRole | None:
        worker = self._workers.get(address)
        return None if worker is None else worker.role

    def add(self, worker: Worker) -> None:
        self._workers[worker.address] = worker
        self.changed()

    def draining(self, address: str) -> bool:
        return address in self._removed

    def drain(self, address: str) -> None:
        """Removed from the pool's work: it finishes what it runs, and counts for nothing any more."""
        self._removed.add(address)
        self.changed()

    def undrain(self, address: str) -> None:
        """Added again while it drained: a member as before."""
        self._removed.discard(address)
        self.changed()

    def any_draining(self) -> bool:
        return bool(self._removed)

    def drained(self) -> list[str]:
        """The members removed and maybe still draining (the driver lets go of those the scheduler has)."""
        return list(self._removed)

    def pop(self, address: str) -> Worker:
        """A drained member let go of."""
        self._removed.discard(address)
        return self._workers.pop(address)

    def denoisers(self) -> list[Worker]:
        """The denoisers of the pool, not those removed (draining), in the order they joined."""
        return [w for a, w in self._workers.items() if a not in self._removed and w.role is WorkerRole.DENOISER]

    # ---- what they can run together ------------------------------------------------------------------------------

    def changed(self) -> None:
        """A member came, went, or said anew what it can run: what the pool can run is worked out again."""
        self._limits = None
        self._loras = None
        self._kinds = None

    def _known(self, role: WorkerRole) -> list[Worker]:
        """The members (not removed) that have said what they can run, in the order they joined."""
        return [w for a, w in self._workers.items()
                if a not in self._removed and w.limits is not None and w.role is role]

    def limits(self) -> Limits:
        """What admission refuses past, and GetLimits serves: what some member of each stage can do (the union of
        their limits; a member down for a moment still counts, so its restart turns no feature into a refusal),
        never more than the gateway's own flags. Whether one member serves all a request asks: ``capable``."""
        if self._limits is None:
            self._limits = limits_in_force(dict(self._own_limits), [w.limits for w in self._known(WorkerRole.AR)],
                                           [w.limits for w in self._known(WorkerRole.DENOISER)])
        return self._limits

    def capable(self, needs: Needs) -> InvalidArgument | None:
        """Why no member of some stage can run a request of ``needs`` (runtime.capability.refusal, the
        field named), or None: it is admitted, and the scheduler places it where it can run."""
        if self._kinds is None:
            self._kinds = {role: list(dict.fromkeys(w.capabilities() for w in self._known(role)))
                           for role in WorkerRole}
        for role in (WorkerRole.AR, WorkerRole.DENOISER):
            why = refusal(needs, self._kinds[role])
            if why is not None:
                return why
        return None

    def lora_catalogue(self) -> dict[str, common_pb2.LoraInfo]:
        """The adapters a request may name, by name: those some denoiser lists (its jobs go only to denoisers that
        list all they name), as the first of them to list each describes it."""
        if self._loras is None:
            catalogue: dict[str, common_pb2.LoraInfo] = {}
            for w in self.denoisers():
                for name, info in (w.loras or {}).items():
                    catalogue.setdefault(name, info)
            self._loras = {name: catalogue[name] for name in sorted(catalogue)}
        return self._loras

    # ---- one member, as GetStatus shows it ---------------------------------------------------------------------

    def health(self, address: str) -> WorkerHealth:
        worker = self._workers.get(address)
        return WorkerHealth.UNKNOWN if worker is None else worker.health

    def health_detail(self, address: str) -> str:
        """What the worker said when that says more than its health (its refusal of the credential); else ""."""
        worker = self._workers.get(address)
        return "" if worker is None else worker.health_detail

    def build(self, address: str) -> common_pb2.BuildInfo:
        """Its release and contract revisions, as its GetLimits last said (gateway.compat); empty if unknown."""
        worker = self._workers.get(address)
        return common_pb2.BuildInfo() if worker is None else worker.build

    def platform(self, address: str) -> Platform:
        """What it runs on (its device, a denoiser's compiled sizes), as its GetLimits last said; empty if unknown."""
        worker = self._workers.get(address)
        return Platform() if worker is None else worker.platform

    def progress(self, address: str) -> tuple[int, int]:
        """The steps done of the job a denoiser runs, and of how many (0, 0: none, or not known yet)."""
        worker = self._workers.get(address)
        return (0, 0) if worker is None else worker.progress
