"""Priority classes: a request's class within its tenant's share of both stages (the scheduler's
RequestArrived.priority), lower first. Their names are the REST front's, the SDK's and the tenants file's; the gRPC
enum Priority is these plus one (PRIORITY_INTERACTIVE = 1). Standard library only: the scheduler imports it."""

from __future__ import annotations

INTERACTIVE, DEFAULT, BATCH = 0, 1, 2
PRIORITY_NAMES: tuple[str, ...] = ("interactive", "default", "batch")
