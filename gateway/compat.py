"""Whether this gateway can speak a worker's contract: the one rule, read where the gateway learns a worker's
limits (gateway.workers, each time the worker comes up, before it gets work).

Each side speaks a range of contract revisions (runtime.version: the newest it speaks and the oldest it
still serves); they work together when the ranges overlap. A worker that reports none (a release older than
revisions, or one without GetLimits) counts as revision 1, so a pool keeps serving across that release boundary.
A worker outside the range gets no work: its health is INCOMPATIBLE (GetStatus, the
glmimage_gateway_workers_incompatible gauge) until it comes up with a revision this gateway speaks.
"""
from __future__ import annotations

from dataclasses import dataclass

from glmimage.v1 import common_pb2
from runtime.version import OLDEST_PROTO_REVISION, PROTO_REVISION, build_info

# What a peer that reports no revision speaks: the contract as it was before revisions were numbered.
UNNUMBERED = 1


@dataclass(frozen=True)
class Revisions:
    """The contract revisions one side speaks, oldest to newest (both inclusive)."""

    oldest: int
    newest: int

    def overlaps(self, other: Revisions) -> bool:
        return self.oldest <= other.newest and other.oldest <= self.newest

    def __str__(self) -> str:
        return str(self.newest) if self.oldest == self.newest else f"{self.oldest}-{self.newest}"


# This gateway's range, from the release's constants.
SPOKEN = Revisions(OLDEST_PROTO_REVISION, PROTO_REVISION)


def revisions_of(build: common_pb2.BuildInfo) -> Revisions:
    """The range a worker's BuildInfo says it speaks (an unset field: revision 1; an unset oldest: its newest)."""
    newest = build.proto_revision or UNNUMBERED
    oldest = build.min_proto_revision or newest
    return Revisions(min(oldest, newest), newest)


def incompatibility(build: common_pb2.BuildInfo, spoken: Revisions = SPOKEN) -> str:
    """Why this gateway must not give the worker work, for GetStatus and the log; "" when it may."""
    theirs = revisions_of(build)
    if theirs.overlaps(spoken):
        return ""
    release = f" (release {build.version}{f', {build.git_commit[:12]}' if build.git_commit else ''})" \
        if build.version else ""
    return f"speaks contract revision {theirs}{release}; this gateway speaks {spoken}"


def gateway_build() -> common_pb2.BuildInfo:
    """This gateway's own, for GetStatus."""
    return build_info()
