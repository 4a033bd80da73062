"""rest/ratelimits.py, the pure part: which metadata entries become headers, which quota refused, and
Retry-After, for any input (hypothesis)."""
from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from rest.ratelimits import (
    DEFAULT_RETRY_AFTER_S,
    RATE_LIMIT_HEADERS,
    quota_of,
    rate_limit_headers,
    retry_after,
)

FIGURES = [("x-ratelimit-reset-images", "1m0s"), ("x-ratelimit-limit-requests", "30"),
           ("x-ratelimit-remaining-images", "7"), ("x-ratelimit-remaining-requests", "29"),
           ("x-ratelimit-limit-images", "60"), ("x-ratelimit-reset-requests", "250ms")]


def test_the_six_figures_in_openai_s_order_and_nothing_else() -> None:
    headers = rate_limit_headers([("x-request-id", "r1"), *FIGURES, ("retry-after", "3"), ("glmimage-error", "1")])
    assert list(headers) == list(RATE_LIMIT_HEADERS)
    assert headers == dict(FIGURES)
    assert RATE_LIMIT_HEADERS[:3] == ("x-ratelimit-limit-requests", "x-ratelimit-remaining-requests",
                                      "x-ratelimit-reset-requests")


def test_the_trailing_figures_win_over_the_initial_ones() -> None:
    initial = [("x-ratelimit-remaining-requests", "5"), ("x-ratelimit-limit-requests", "30")]
    trailing = [("x-ratelimit-remaining-requests", "0")]
    assert rate_limit_headers(initial, trailing) == {"x-ratelimit-limit-requests": "30",
                                                     "x-ratelimit-remaining-requests": "0"}
    assert rate_limit_headers(None, ()) == {}


def test_values_a_header_cannot_carry_are_dropped() -> None:
    bad = [("x-ratelimit-limit-requests", "3\r\nx-evil: 1"), ("x-ratelimit-limit-images", b"60"),
           ("x-ratelimit-reset-images", ""), ("x-ratelimit-reset-requests", "9" * 65),
           ("x-ratelimit-remaining-images", "sieben ")]
    assert rate_limit_headers(bad) == {}
    assert rate_limit_headers([("X-RateLimit-Limit-Requests", "30")]) == {"x-ratelimit-limit-requests": "30"}


def test_the_quota_that_refused() -> None:
    assert quota_of([("x-glmimage-quota", "images_per_minute")]) == "images_per_minute"
    assert quota_of([("retry-after", "1")]) is None  # a full queue names none
    assert quota_of(None) is None
    assert quota_of([("x-glmimage-quota", "<script>")]) is None


def test_retry_after_prefers_the_key_then_the_retry_info() -> None:
    assert retry_after([("retry-after", "12")], 3.2) == "12"
    assert retry_after([("retry-after", "0")]) == "1"
    assert retry_after([("retry-after", "soon")], 3.2) == "4"
    assert retry_after((), 0.001) == "1"
    assert retry_after(()) == str(DEFAULT_RETRY_AFTER_S)


@given(st.lists(st.tuples(st.sampled_from(["retry-after", "x-glmimage-quota", "other"]),
                          st.text(max_size=8) | st.binary(max_size=4))),
       st.none() | st.floats(allow_nan=True, allow_infinity=True))
def test_retry_after_is_always_whole_seconds_from_one_to_a_day(trailing, delay) -> None:
    value = retry_after(trailing, delay)
    assert value.isascii() and value.isdigit() and 1 <= int(value) <= 86_400


@given(st.lists(st.tuples(st.sampled_from([*RATE_LIMIT_HEADERS, "x-other"]), st.text(max_size=80))))
def test_every_relayed_value_is_a_printable_token(entries) -> None:
    for name, value in rate_limit_headers(entries).items():
        assert name in RATE_LIMIT_HEADERS
        assert 1 <= len(value) <= 64 and all("\x21" <= c <= "\x7e" for c in value)
