"""What this process is: its release (the package version, and the git commit when the build recorded one) and the
contract revisions it speaks. Workers send it in GetLimits, the gateway shows its own and each worker's in GetStatus
(common.proto BuildInfo); gateway.compat decides from it whether a gateway and a worker can work together.

The revisions are defined here once, for every process of a release: the bump rule is in protos/README.md.
"""
from __future__ import annotations

import functools
import importlib.metadata
import os

from glmimage.v1 import common_pb2

# The newest contract revision this release speaks, and the oldest one it still serves (as a worker) and sends
# work to (as a gateway). A peer that reports no revision (0: a release older than revisions) counts as revision 1.
PROTO_REVISION = 1
OLDEST_PROTO_REVISION = 1

PACKAGE = "glmimage-serving"
# Set at image build time (docker/Dockerfile's GIT_COMMIT build argument): no git call at run time.
COMMIT_ENV = "GLMIMAGE_GIT_COMMIT"
_COMMIT_CHARS = 40


@functools.cache
def package_version() -> str:
    """The installed package's version; "unknown" when run from a tree that was never installed."""
    try:
        return importlib.metadata.version(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def git_commit() -> str:
    """The commit the build recorded, if any (at most 40 characters of it: it is shown, never trusted)."""
    return os.environ.get(COMMIT_ENV, "").strip()[:_COMMIT_CHARS]


def build_info() -> common_pb2.BuildInfo:
    return common_pb2.BuildInfo(version=package_version(), git_commit=git_commit(), proto_revision=PROTO_REVISION,
                                min_proto_revision=OLDEST_PROTO_REVISION)
