"""The scheduler core's 503s: no ready worker for a stage, and workers refusing the gateway's credential.
"""

from __future__ import annotations

from gateway.scheduler.types import (
    CancelArBatch,
    CancelDenoise,
    CompleteRequest,
    DenoiseFailed,
    DenoiseSucceeded,
    DispatchArBatch,
    DispatchDenoise,
    FailRequest,
    WorkerAdded,
    WorkerDown,
    WorkerHealthy,
    WorkerNotServing,
    WorkerRole,
    WorkerState,
    WorkerUnhealthy,
)
from runtime.errors import ErrorKind
from tests.support.scheduler_events import ar_ok, arrive, job, make, only, ready, to_denoise, up, worker
from tests.support.scheduler_model import AR, DN

# ------------------------------------------------------------------------------------------ fail fast (503)


def test_fail_fast_refuses_admission_without_a_ready_worker_per_stage() -> None:
    s = make(fail_fast_without_workers=True)
    (rej,) = arrive(s, "a")
    assert isinstance(rej, FailRequest) and rej.error.kind is ErrorKind.UNAVAILABLE and "AR" in rej.error.message
    up(s, "ar", WorkerRole.AR)
    (rej,) = arrive(s, "b")
    assert rej.error.kind is ErrorKind.UNAVAILABLE and "denoiser" in rej.error.message
    up(s, "d", WorkerRole.DENOISER)
    assert not only(arrive(s, "c"), FailRequest)
    assert s.counters.rejected == 2 and s.counters.admitted == 1


def test_fail_fast_fails_requests_stranded_in_the_ar_queue_when_the_last_ar_goes() -> None:
    s = make(fail_fast_without_workers=True, ar_batch_delay=10.0, ar_retries=1)
    up(s, "ar", WorkerRole.AR)
    up(s, "d", WorkerRole.DENOISER)
    assert arrive(s, "a") == [] and arrive(s, "b") == []  # waiting for the batch delay
    failed = only(s.handle(WorkerUnhealthy(1.0, "ar")), FailRequest)
    assert sorted(f.request_id for f in failed) == ["a", "b"]
    assert all(f.error.kind is ErrorKind.UNAVAILABLE and "AR" in f.error.message for f in failed)
    assert s.snapshot().active_requests == 0


def test_fail_fast_fails_requests_waiting_for_a_denoiser_when_the_last_one_goes() -> None:
    s = make(fail_fast_without_workers=True, ar_batch_delay=0.0)
    up(s, "ar", WorkerRole.AR)
    up(s, "d", WorkerRole.DENOISER)
    (d,) = only(to_denoise(s, "a", 2), DispatchDenoise)  # a/0 runs, a/1 waits
    (b,) = only(arrive(s, "b", 1, now=0.5), DispatchArBatch)  # b is in the AR stage meanwhile
    acts = s.handle(WorkerNotServing(1.0, "d"))  # draining: it finishes a/0 but takes nothing new
    (fail,) = only(acts, FailRequest)
    assert fail.request_id == "a" and fail.error.kind is ErrorKind.UNAVAILABLE and "denoiser" in fail.error.message
    assert only(acts, CancelDenoise) == [CancelDenoise(d.job, "d")]  # nobody is left to want a/0
    # b reaches the denoise stage with no denoiser to take it: it fails then, not at its deadline.
    (fail_b,) = only(ar_ok(s, b, {"b": 1}, now=2.0), FailRequest)
    assert fail_b.request_id == "b" and fail_b.error.kind is ErrorKind.UNAVAILABLE
    assert s.snapshot().active_requests == 0


# ------------------------------------------------------------------ a worker that refuses the gateway's credential


def test_a_denoiser_refusing_the_credential_sends_its_job_elsewhere_without_using_an_attempt() -> None:
    s = ready(max_attempts=1)  # one try only: a refusal of the credential must not use it up
    (first,) = to_denoise(s, "a")
    assert first == DispatchDenoise(job("a"), "d0", "a/ar0")
    acts = s.handle(WorkerUnhealthy(1.0, "d0", WorkerDown.CREDENTIAL_REFUSED))
    assert acts == [CancelDenoise(job("a"), "d0"), DispatchDenoise(job("a", attempt=2), "d1", "a/ar0")]
    assert worker(s, "d0").state is WorkerState.UNHEALTHY
    # The refused call's own end is fenced; the job finishes on d1.
    assert s.handle(DenoiseFailed(1.1, job("a"), "d0", "refused", retryable=False)) == []
    (done,) = s.handle(DenoiseSucceeded(2.0, job("a", attempt=2), "d1", "img"))
    assert isinstance(done, CompleteRequest)


def test_a_job_refused_by_every_denoiser_in_turn_still_has_all_its_attempts() -> None:
    s = ready(max_attempts=2)
    to_denoise(s, "a")
    for attempt, name in enumerate(("d0", "d1", "d2"), start=1):
        (redo,) = only(s.handle(WorkerUnhealthy(float(attempt), name, WorkerDown.CREDENTIAL_REFUSED)),
                       DispatchDenoise)
        assert redo.job == job("a", attempt=attempt + 1)
    # d3 now holds attempt 4; a real failure uses the first of its two tries, the next one the second.
    (retry,) = s.handle(DenoiseFailed(5.0, job("a", attempt=4), "d3", "boom", retryable=True))
    assert retry.job == job("a", attempt=5) and retry.worker == "d3"
    (fail,) = s.handle(DenoiseFailed(6.0, job("a", attempt=5), "d3", "boom", retryable=True))
    assert isinstance(fail, FailRequest) and "after 2 attempt(s)" in fail.error.message


def test_an_ar_refusing_the_credential_sends_its_batch_to_another_ar_without_using_a_retry() -> None:
    s = make(ar_retries=0, ar_batch_delay=0.0)  # no retry budget: a charged failure would fail the request
    up(s, "ar0", AR)
    up(s, "ar1", AR)
    (b1,) = arrive(s, "a", 1)
    acts = s.handle(WorkerUnhealthy(1.0, "ar0", WorkerDown.CREDENTIAL_REFUSED))
    assert acts[0] == CancelArBatch(b1.batch_id, "ar0")
    (b2,) = only(acts, DispatchArBatch)
    assert (b2.worker, b2.request_ids) == ("ar1", ("a",)) and not only(acts, FailRequest)


def test_with_the_only_ar_refusing_the_credential_requests_fail_with_a_503_that_says_so() -> None:
    s = make(fail_fast_without_workers=True, ar_batch_delay=0.0)
    up(s, "ar0", AR)
    up(s, "d0", DN)
    arrive(s, "a", 1)
    (fail,) = only(s.handle(WorkerUnhealthy(1.0, "ar0", WorkerDown.CREDENTIAL_REFUSED)), FailRequest)
    assert fail.error.kind is ErrorKind.UNAVAILABLE
    assert fail.error.message == ("no AR server is available (it refuses the gateway's credential (its internal "
                                  "token)); retry later")
    # New requests are refused at admission with the same reason.
    (rej,) = arrive(s, "b", now=2.0)
    assert rej.error.kind is ErrorKind.UNAVAILABLE and "refuses the gateway's credential" in rej.error.message


def test_workers_refusing_the_credential_from_the_start_are_named_in_the_503() -> None:
    # They never were healthy (they refused the check when they joined): the reason still reaches the message.
    s = make(fail_fast_without_workers=True)
    up(s, "ar0", AR)
    s.handle(WorkerAdded(0.0, "d0", DN))
    assert s.handle(WorkerUnhealthy(0.0, "d0", WorkerDown.CREDENTIAL_REFUSED)) == []
    (rej,) = arrive(s, "a")
    assert rej.error.message == ("no denoiser is available (it refuses the gateway's credential (its internal token)); "
                           "retry later")
    s.handle(WorkerAdded(0.0, "d1", DN))
    s.handle(WorkerUnhealthy(0.0, "d1", WorkerDown.HUNG))
    (rej,) = arrive(s, "b")
    assert rej.error.message == ("no denoiser is available (one is not answering (hung); one refuses the gateway's "
                           "credential (its internal token)); retry later")
    assert not only(s.handle(WorkerHealthy(1.0, "d1")), FailRequest)
    assert not only(arrive(s, "c", now=1.0), FailRequest)


def test_a_hung_ar_is_reported_as_not_answering_not_as_gone() -> None:
    s = make(fail_fast_without_workers=True, ar_batch_delay=0.0, ar_retries=1)
    up(s, "ar0", AR)
    up(s, "d0", DN)
    arrive(s, "a", 1)
    (fail,) = only(s.handle(WorkerUnhealthy(1.0, "ar0", WorkerDown.HUNG)), FailRequest)
    assert fail.error.message == "no AR server is available (it is not answering (hung)); retry later"
    up(s, "ar0", AR, now=2.0)  # back, then gone for good
    arrive(s, "b", 1, now=2.0)
    (fail,) = only(s.handle(WorkerUnhealthy(3.0, "ar0")), FailRequest)
    assert fail.error.message == "no AR server is available (it went away); retry later"
    # Without retries left, the batch's own failure says the same.
    s = make(ar_batch_delay=0.0, ar_retries=0)
    up(s, "ar0", AR)
    arrive(s, "c", 1)
    (fail,) = only(s.handle(WorkerUnhealthy(1.0, "ar0", WorkerDown.HUNG)), FailRequest)
    assert fail.error.message == "AR stage failed: the AR server running it is not answering (hung)"


def test_without_fail_fast_requests_wait_for_workers() -> None:
    s = make()
    assert arrive(s, "a") == []
    assert s.snapshot().pending_ar_requests == 1
