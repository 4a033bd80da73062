"""The scheduler's pool bookkeeping: the workers it knows, by address and by role; how many of each role take work;
and the choice of a free one (the next free denoiser in this gateway's own rotation, off a heap; the least loaded AR
server).

What a worker's state means for the work it holds (requeue, fence, drain) is policy: core.Scheduler decides it and
calls in here to change the books.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from .speed import AR, DENOISER
from .types import JobId, WorkerDown, WorkerRole, WorkerSnapshot, WorkerState

_AVAILABLE, _BUSY, _DRAINING, _UNHEALTHY = (WorkerState.AVAILABLE, WorkerState.BUSY, WorkerState.DRAINING,
                                            WorkerState.UNHEALTHY)


@dataclass(slots=True, eq=False)
class Worker:
    address: str
    role: WorkerRole
    added_seq: int  # the last tie-break of every choice, so that choices are deterministic
    # Denoisers: its place in this gateway's rotation (see Pool.offer); unique, as it ends in added_seq.
    rank: int = 0
    healthy: bool = False  # a new worker is unhealthy until its first health check passes
    draining: bool = False
    not_serving: bool = False  # healthy but said NOT_SERVING: finishing what it holds, takes nothing new
    last_used: int = 0  # AR servers: for the least recently used choice
    job: JobId | None = None  # denoisers: the one job whose slot this worker holds
    offered: bool = False  # denoisers: has its one entry in Pool.idle
    batches: set[int] = field(default_factory=set)  # AR: batch ids in flight
    # Denoisers: another gateway's job holds the slot, as its occupancy stream (or a busy refusal) said, at
    # sequence ``occupancy_seq``; such a denoiser gets no job from here until it is free again.
    elsewhere: bool = False
    occupancy_seq: int = -1
    # accepts_work() as of the last change to its flags, kept by Pool.recount (False once forgotten): it is what the
    # ready counts count, and what the dispatch paths read instead of calling accepts_work().
    ready: bool = False
    # Why it last stopped taking work (None since it was last healthy, or never checked): what the message of a
    # request that finds no worker of its stage says.
    down: WorkerDown | None = None
    # The state it is counted under in Pool.standing while it takes no work (DRAINING or UNHEALTHY; None: it is ready,
    # or not a member).
    standing: WorkerState | None = None
    # Denoisers: the LoRA adapters it holds, as its occupancy stream last said, plus those of the job it runs for
    # this gateway (loaded by the time it ends); kept by Pool.set_loras with the index Pool.holders.
    loras: frozenset[str] = frozenset()
    # What it can run, as its WorkerCapabilities last said (opaque; None: not known), kept by capability.Capability.
    caps: object = None

    def busy(self) -> bool:
        return self.job is not None or bool(self.batches)

    def accepts_work(self) -> bool:
        return self.healthy and not self.draining and not self.not_serving


class Pool:
    """The members (a removed worker stays one until it has drained), and the counts and heap kept over them."""

    __slots__ = ("members", "by_role", "ar_servers", "ready_ar", "ready_denoisers", "held_elsewhere", "standing",
                 "idle", "holders", "_ar_room", "_added", "_clock", "_seed", "_lap", "_at")

    def __init__(self, ar_max_inflight_batches: int, pick_seed: str | None = None) -> None:
        self.members: dict[str, Worker] = {}
        # The same workers by role, so a choice among the few AR servers does not scan every denoiser.
        self.by_role: dict[WorkerRole, dict[str, Worker]] = {r: {} for r in WorkerRole}
        self.ar_servers = self.by_role[AR]  # looked up on every event; an enum's hash is not free
        # How many members of each role accept work, kept by recount, so that "is any worker of this stage ready"
        # (asked on every event with fail-fast on) costs O(1), not a scan of the denoiser pool.
        self.ready_ar = 0
        self.ready_denoisers = 0
        # Members whose slot another gateway's job holds (Worker.elsewhere), kept by hold_elsewhere.
        self.held_elsewhere = 0
        # The members that take no work, by role and state (from their flags, kept by recount), so that the metrics'
        # counts by role and state cost no walk of the pool (see state_counts).
        self.standing: dict[tuple[WorkerRole, WorkerState], int] = {
            (r, s): 0 for r in WorkerRole for s in (_DRAINING, _UNHEALTHY)}
        # Heap of denoisers that may be free, by their place in the rotation (lap, rank): the next one after the
        # last taken, without scanning the pool. Validated lazily when it reaches the top (see take_free_denoiser).
        self.idle: list[tuple[int, int, Worker]] = []
        # Adapter name -> the denoisers holding it (Worker.loras), so that a job's holders are found without a scan.
        self.holders: dict[str, set[Worker]] = {}
        self._ar_room = ar_max_inflight_batches
        self._added = itertools.count(1)
        self._clock = itertools.count(1)  # logical clock for least-recently-used choices (AR servers)
        # The rotation's order: the denoisers by rank, which with a seed is a permutation of its own (a hash of the
        # seed and the address), so that gateways sharing a pool, each seeded with its own id, do not reach for the
        # same free denoisers in the same order; without one, the order they joined in. The cursor: the lap and the
        # rank of the denoiser taken last.
        self._seed = pick_seed
        self._lap, self._at = 0, 0

    # ------------------------------------------------------------------------------------------------ membership

    def add(self, address: str, role: WorkerRole) -> Worker:
        """A new member, unhealthy until its first health check passes (the caller recounts it)."""
        seq = next(self._added)
        w = self.members[address] = Worker(address, role, added_seq=seq, rank=self._rank(address, seq))
        self.by_role[role][address] = w
        return w

    def _rank(self, address: str, seq: int) -> int:
        if self._seed is None:
            return seq
        digest = hashlib.blake2b(f"{self._seed}\n{address}".encode(), digest_size=8).digest()
        return (int.from_bytes(digest, "big") << 32) + seq

    def forget(self, w: Worker) -> None:
        """Drop a worker from membership (its heap entry, if any, is discarded when it reaches the top)."""
        del self.members[w.address]
        del self.by_role[w.role][w.address]
        self.recount(w, member=False)
        self.hold_elsewhere(w, False)
        self.set_loras(w, frozenset())

    def set_loras(self, w: Worker, loras: frozenset[str]) -> None:
        """Set the adapters w holds, keeping the index by adapter."""
        if loras == w.loras:
            return
        holders = self.holders
        for name in w.loras - loras:
            owners = holders[name]
            owners.discard(w)
            if not owners:
                del holders[name]
        for name in loras - w.loras:
            holders.setdefault(name, set()).add(w)
        w.loras = loras

    def hold_elsewhere(self, w: Worker, held: bool) -> None:
        """Set whether another gateway's job holds w's slot, keeping the count of such members."""
        if held is not w.elsewhere:
            self.held_elsewhere += 1 if held else -1
            w.elsewhere = held

    def recount(self, w: Worker, member: bool = True) -> None:
        """Bring the ready counts up to date after a change to a worker's healthy, draining or not_serving flag,
        or to its membership (``member=False``: forget).

        Every such change calls this, so the counts always equal the number of members for which accepts_work()
        holds, and w.ready says whether w is one of them."""
        ready = member and w.accepts_work()
        standing = None if ready or not member else _DRAINING if w.draining or w.healthy else _UNHEALTHY
        if standing is not w.standing:
            if w.standing is not None:
                self.standing[w.role, w.standing] -= 1
            if standing is not None:
                self.standing[w.role, standing] += 1
            w.standing = standing
        if ready is not w.ready:
            w.ready = ready
            delta = 1 if ready else -1
            if w.role is AR:
                self.ready_ar += delta
            else:
                self.ready_denoisers += delta

    def any_ready(self, role: WorkerRole) -> bool:
        """Whether some member of ``role`` accepts work (what a scan of accepts_work() would say)."""
        return (self.ready_ar if role is AR else self.ready_denoisers) > 0

    def none_ready(self, role: WorkerRole, default: str | None) -> str:
        """The client's message when no worker of ``role`` takes work: with why its members stopped (distinct, in
        WorkerDown's order), or ``default`` when they only went away or gave no reason. Off the hot path: only a
        request that finds its stage empty reads it."""
        given = {w.down for w in self.by_role[role].values() if w.down is not None}
        whys = [d for d in WorkerDown if d in given]
        if whys and whys != [WorkerDown.GONE]:
            why: str | None = f"it {whys[0].value}" if len(whys) == 1 else "; ".join(f"one {d.value}" for d in whys)
        else:
            why = default
        stage = "no AR server is available" if role is AR else "no denoiser is available"
        return f"{stage} ({why}); retry later" if why else f"{stage}; retry later"

    # ------------------------------------------------------------------------------------------ free-worker choice

    def used(self, w: Worker) -> None:
        """AR server ``w`` was just given a batch: it is now the most recently used (see free_ar_server)."""
        w.last_used = next(self._clock)

    def offer(self, w: Worker) -> None:
        """Give a denoiser that may have become free its entry in the idle heap (one at most: the entry leaves the
        heap before the worker is offered again), at its place in the rotation after the cursor: in this lap if its
        rank comes after the last taken, else in the next. So a denoiser back from another gateway's job, or from
        being down, waits its turn instead of going first (as it would by least recent use here), which is what
        makes every gateway reach for a denoiser the moment it is free."""
        if w.role is DENOISER and not w.offered and w.ready and w.job is None \
                and not w.elsewhere:
            w.offered = True
            lap = self._lap if w.rank > self._at else self._lap + 1
            heapq.heappush(self.idle, (lap, w.rank, w))

    def take_free_denoiser(self) -> Worker | None:
        """The next free denoiser in the rotation, taken out of the idle heap, the cursor moved to it: the caller
        dispatches to it.

        An entry whose worker is gone, unhealthy, not serving or busy is dropped: each of those ways back to free
        passes through offer, which pushes it again."""
        heap = self.idle
        while heap:
            lap, rank, w = heapq.heappop(heap)
            w.offered = False
            # (ready also says it is still a member: forget() clears it, and a worker added again is a new object)
            if w.ready and w.job is None and not w.elsewhere:
                self._lap, self._at = lap, rank
                return w
        return None

    def holders_of(self, want: frozenset[str]) -> list[Worker]:
        """The members that hold every adapter of ``want`` (non-empty), by rank: from the rarest adapter's holders."""
        sets = [self.holders.get(name) for name in want]
        if not all(sets):
            return []
        rarest = min(sets, key=len)  # type: ignore[arg-type]
        return sorted((w for w in rarest if want <= w.loras), key=lambda w: w.rank)

    def take_denoiser_for(self, want: frozenset[str], holders: list[Worker] | None = None,
                          able: Callable[[Worker], bool] | None = None) -> Worker | None:
        """A free denoiser for a job naming ``want``, taken (the caller dispatches to it): the one in ``holders``
        (from holders_of) that comes next in the rotation, if any is free; else, among every free one, the one that
        holds most of them, then the fewest others (a plain job, want empty: the one holding fewest, which keeps
        the holders for the jobs that need them), then the next in the rotation. With ``able``, only a denoiser it
        accepts (one that can run the job: capability.py). None: none is free (and able).

        It walks the idle heap (the free denoisers, short when the pool is busy), dropping entries that are no
        longer free as take_free_denoiser does; the entry of the one taken stays and is dropped when it reaches the
        top (its worker is busy by then)."""
        if holders:
            for w in holders:
                if w.offered and w.ready and w.job is None and not w.elsewhere and (able is None or able(w)):
                    return w
        heap = self.idle
        best: Worker | None = None
        best_key: tuple[int, int, int, int] = (0, 0, 0, 0)
        live: list[tuple[int, int, Worker]] = []
        for entry in heap:
            lap, rank, w = entry
            if not (w.ready and w.job is None and not w.elsewhere):
                w.offered = False
                continue
            live.append(entry)
            if able is not None and not able(w):
                continue
            held = w.loras
            key = (-len(held & want), len(held - want), lap, rank)
            if best is None or key < best_key:
                best, best_key = w, key
        if len(live) != len(heap):
            heapq.heapify(live)
            heap[:] = live
        return best

    def free_ar_server(self) -> Worker | None:
        """The AR worker with room that holds the fewest batches, then was used least recently (then joined first).
        (A loop, not min() over a list with a key function: this runs for every batch and every next_wakeup().)"""
        room = self._ar_room
        best: Worker | None = None
        best_key: tuple[int, int, int] = (0, 0, 0)
        for w in self.ar_servers.values():
            if w.ready and len(w.batches) < room:
                key = (len(w.batches), w.last_used, w.added_seq)
                if best is None or key < best_key:
                    best, best_key = w, key
        return best

    def free_ar_servers(self) -> list[Worker]:
        """Every AR worker with room, in free_ar_server's order (for capability.py's pass, in a mixed pool)."""
        room = self._ar_room
        free = [w for w in self.ar_servers.values() if w.ready and len(w.batches) < room]
        free.sort(key=lambda w: (len(w.batches), w.last_used, w.added_seq))
        return free

    # ---------------------------------------------------------------------------------------------- snapshots

    def state_counts(self) -> dict[tuple[WorkerRole, WorkerState], int]:
        """How many members of each role are in each state (what snapshots() would count), without a walk of the
        denoisers: the counts kept above, a look at the AR servers (few), and the free denoisers, which are those
        of the idle heap's entries that are still valid (every free denoiser has one, as nothing else would give
        it work; the heap is short when the pool is busy). Counted here, not kept: keeping them would cost every
        denoise job a few steps, and the scheduler's speed is counted in those."""
        counts = dict(self.standing)
        room = self._ar_room
        ar_busy = sum(1 for w in self.ar_servers.values() if w.ready and len(w.batches) >= room)
        counts[AR, _BUSY] = ar_busy
        counts[AR, _AVAILABLE] = self.ready_ar - ar_busy
        free = sum(1 for _, _, w in self.idle if w.ready and w.job is None and not w.elsewhere)
        counts[DENOISER, _BUSY] = self.ready_denoisers - free
        counts[DENOISER, _AVAILABLE] = free
        return counts

    def snapshots(self) -> tuple[WorkerSnapshot, ...]:
        return tuple(self._snapshot(w) for w in self.members.values())

    def _snapshot(self, w: Worker) -> WorkerSnapshot:
        if w.role is AR:
            inflight = len(w.batches)
            full = inflight >= self._ar_room
        else:
            inflight = 0 if w.job is None else 1
            full = w.job is not None or w.elsewhere
        if w.draining:
            state = WorkerState.DRAINING
        elif not w.healthy:
            state = WorkerState.UNHEALTHY
        elif w.not_serving:
            state = WorkerState.DRAINING  # by its own choice: it said NOT_SERVING
        elif full:
            state = WorkerState.BUSY
        else:
            state = WorkerState.AVAILABLE
        return WorkerSnapshot(w.address, w.role, state, inflight, w.job, held_elsewhere=w.elsewhere, loras=w.loras)
