"""LoRA placement: the denoise pass while some request names adapters or some denoiser holds one, and what it learns.

core.Scheduler owns the queue and the pool and calls in here for the pass (``Placement.dispatch``); what it keeps
between passes is here: how many active requests name adapters, the learned cost of a job's loads and time of a job,
and when a job waiting for a busy holder stops waiting (a Tick then places it elsewhere).
"""

from __future__ import annotations

from collections.abc import Callable

from .fair_queue import DenoiseQueue, QueueKey
from .pool import Pool, Worker
from .records import Output, Request
from .speed import NEVER
from .types import BATCH, Action, JobId

# The pass looks this many jobs that would have to load ahead at a time for later jobs that would not: it stays short
# with a long queue.
_AFFINITY_WINDOW = 256


class Placement:
    """The LoRA placement's state, and its denoise pass."""

    __slots__ = ("requests", "load_cost", "job_time", "recheck_at")

    def __init__(self, load_cost: float) -> None:
        self.requests = 0  # active requests naming adapters (kept by the core)
        self.load_cost = load_cost  # seconds of one job's loads: learned from what jobs say
        self.job_time: float | None = None  # seconds of a job without its loads (None until a job has told)
        self.recheck_at = NEVER  # when a job waiting for a busy holder stops waiting

    def learn_job(self, seconds: float, load_s: float) -> None:
        """Learn a job's time without its loads, and the time of its loads if it loaded (moving averages)."""
        if load_s > 0:
            self.load_cost += 0.25 * (load_s - self.load_cost)
        run = max(seconds - load_s, 0.0)
        self.job_time = run if self.job_time is None else self.job_time + 0.25 * (run - self.job_time)

    def dispatch(self, queue: DenoiseQueue, pool: Pool, now: float, active: dict[str, Request],
                 start_job: Callable[[Worker, QueueKey, list[Action]], None],
                 live_output: Callable[[JobId, str], tuple[Request, Output] | None], actions: list[Action],
                 can_run: Callable[[Request, Worker], bool] | None = None, affinity: bool = True) -> None:
        """The denoise pass while some request names LoRA adapters, or some denoiser holds one, or some request
        cannot run on every kind of denoiser in the pool (``can_run``, capability.Capability's: such a job goes only
        where it can run, and waits while those are busy; the jobs behind it go on, a window at a time). Without
        ``affinity`` (SchedulerConfig.lora_affinity off) no job waits for a holder: each goes at its turn.

        In queue order (the fair order of fair_queue.DenoiseQueue), over a window of the queue at a time, while a
        denoiser is free:
        1. a job goes to a free denoiser that holds all its adapters (a hit), even past jobs ahead of it that would
           have to load: that saves a load, and a denoiser that holds nothing they need serves them as well;
           a plain job goes at its turn, to the free denoiser holding fewest adapters (the holders stay free);
        2. a job that must load and was passed over for one load's time already (``Output.passed_at``) loads at its
           turn, before any later job's hit: how long affinity may hold a job back is one load, however long the
           queue (counting from when it was queued would let no job wait once the queue is longer than a load);
        3. then, in order, each job that would load: it waits for a busy denoiser holding its adapters if that one
           should free up before the bound of (2) ends (passed over: the jobs behind it go on), else it loads on
           the free denoiser that holds most of its adapters and fewest others (Pool.take_denoiser_for).
        So a popular adapter's jobs never hold up the others, nor plain jobs, for longer than a load. A batch-class
        job is not looked at while a job of another class stays queued (it waits for a holder): the batch job would
        take the denoiser it may load on when its wait ends.

        Every job looked at is taken off the queue (its tenant charged, so the jobs behind come in fair order) and
        the jobs left are put back at the end, uncharged (DenoiseQueue.take and put_back)."""
        bound = self.load_cost
        recheck = NEVER
        held = False  # a non-batch job looked at is still queued (kept, or in ``loading``)
        unable = 0  # jobs kept because no free denoiser can run them: a window of them at most per pass
        queue.begin()
        while queue.first is not None and pool.idle and not (held and queue.first[0] == BATCH) \
                and unable < _AFFINITY_WINDOW:
            # Steps 1 and 2 over the next window of the queue; the jobs that would load, for step 3.
            loading: list[tuple[QueueKey, frozenset[str], int]] = []
            dispatched = 0  # dispatches so far in this window: a job set aside before one of them was passed over
            while queue.first is not None and pool.idle and len(loading) < _AFFINITY_WINDOW \
                    and unable < _AFFINITY_WINDOW:
                if queue.first[0] == BATCH and (held or (loading and loading[0][0][0] != BATCH)):
                    break  # step 3 first: whether a job of another class stays queued (they come first)
                key = queue.take()
                req = active[key[4]]
                want = req.loras
                able = _able(req, can_run)
                w = pool.take_denoiser_for(want, pool.holders_of(want) if want else None, able)
                if w is None:
                    queue.keep(key)
                    held = held or key[0] != BATCH
                    if able is not None and pool.idle:
                        unable += 1  # denoisers are free, none of them can run it: the jobs behind it go on
                        continue
                    break
                passed_at = req.outputs[key[3]].passed_at
                if not want or not affinity or want <= w.loras or (passed_at is not None and now >= passed_at + bound):
                    start_job(w, key, actions)
                    dispatched += 1
                else:
                    loading.append((key, want, dispatched))
            # Step 3.
            waiting: dict[frozenset[str], int] = {}  # adapter set -> its jobs waiting for a holder in this pass
            for key, want, before in loading:
                req = active[key[4]]
                out = req.outputs[key[3]]
                able = _able(req, can_run)
                holders = pool.holders_of(want)
                if able is not None:
                    holders = [h for h in holders if able(h)]  # a holder that cannot run it is no place to wait
                w = pool.take_denoiser_for(want, holders, able) if pool.idle else None
                if w is None:
                    if dispatched > before and out.passed_at is None:
                        out.passed_at = now  # later jobs' hits took the free denoisers it could have loaded on
                    queue.keep(key)
                    held = held or key[0] != BATCH
                    continue
                until = (now if out.passed_at is None else out.passed_at) + bound
                ahead = waiting.get(want, 0)
                if not want <= w.loras and holders and now < until \
                        and self._holder_free_by(holders, ahead, live_output) < until:
                    waiting[want] = ahead + 1
                    if out.passed_at is None:
                        out.passed_at = now
                    recheck = min(recheck, until)
                    queue.keep(key)
                    held = held or key[0] != BATCH
                    continue
                start_job(w, key, actions)
                dispatched += 1
        queue.put_back()
        self.recheck_at = recheck

    def _holder_free_by(self, holders: list[Worker], ahead: int,
                        live_output: Callable[[JobId, str], tuple[Request, Output] | None]) -> float:
        """When a busy holder should be free for a job with ``ahead`` jobs of its adapters before it (passed over
        in this pass): from the learned time of a job; never, before a job has told it, or with no busy holder of
        this gateway's (another gateway's job gives no start time)."""
        job_time = self.job_time
        if job_time is None:
            return NEVER
        starts = []
        for w in holders:
            if w.ready and w.job is not None and not w.elsewhere:
                live = live_output(w.job, w.address)
                if live is not None:
                    starts.append(live[1].started_at)
        if not starts:
            return NEVER
        starts.sort()
        rounds, slot = divmod(ahead, len(starts))
        return starts[slot] + job_time * (rounds + 1)


def _able(req: Request, can_run: Callable[[Request, Worker], bool] | None) -> Callable[[Worker], bool] | None:
    """Which denoisers may take ``req``'s job: None (any) unless some kind in the pool cannot run it."""
    if can_run is None or not req.restricted:
        return None
    return lambda w: can_run(req, w)
