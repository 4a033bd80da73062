"""The pool as the driver holds it (gateway/members.py): what its members can run together follows every change of
members, a draining one included (it counts for nothing from the moment it is removed, and again once re-added)."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from gateway.config import GatewayConfig
from gateway.members import Members
from gateway.scheduler.types import WorkerRole
from gateway.workers import Worker, WorkerHealth
from glmimage.v1 import common_pb2
from runtime.capability import Needs

AR, DENOISER = WorkerRole.AR, WorkerRole.DENOISER


@pytest.fixture
async def pool() -> AsyncIterator[tuple[Members, dict[str, Worker]]]:
    """One AR and two denoisers that have said their limits: "d-100" up to 100 steps with adapter "y", "d-50" up to
    50 with "x". No channel is ever used (nothing is dialled until a call)."""
    config = GatewayConfig(ar_addresses=(), denoiser_addresses=())
    members = Members(config.own_limits)
    workers = {"ar": Worker("127.0.0.1:1", AR, config), "d-50": Worker("127.0.0.1:2", DENOISER, config),
               "d-100": Worker("127.0.0.1:3", DENOISER, config)}
    for worker in workers.values():
        members.add(worker)
    workers["ar"].limits = {}
    workers["d-50"].limits, workers["d-50"].loras = {"max_steps": 50}, {"x": common_pb2.LoraInfo(name="x")}
    workers["d-100"].limits, workers["d-100"].loras = {"max_steps": 100}, {"y": common_pb2.LoraInfo(name="y")}
    members.changed()  # as the driver does when a member's GetLimits or listing answers
    yield members, workers
    await asyncio.gather(*(w.channel.close() for w in workers.values()))


async def test_a_drained_member_counts_for_nothing_and_again_once_re_added(pool) -> None:
    members, workers = pool
    d100 = workers["d-100"].address
    assert members.limits().max_steps == 100 and set(members.lora_catalogue()) == {"x", "y"}
    assert members.capable(Needs(steps=100)) is None and members.capable(Needs(loras=("y",))) is None
    assert members.capable(Needs(steps=100, loras=("x",))) is not None  # no one denoiser runs both

    members.drain(d100)
    assert members.draining(d100) and members.any_draining() and members.drained() == [d100]
    assert len(members) == 3  # still held (it finishes its job), but no longer in what the pool can run
    assert members.limits().max_steps == 50 and set(members.lora_catalogue()) == {"x"}
    assert [w.address for w in members.denoisers()] == [workers["d-50"].address]
    assert members.capable(Needs(steps=100)).field == "num_inference_steps"
    assert members.capable(Needs(loras=("y",))) is not None

    members.undrain(d100)  # re-added while it drained: a member as before
    assert not members.any_draining() and members.limits().max_steps == 100
    assert set(members.lora_catalogue()) == {"x", "y"} and members.capable(Needs(loras=("y",))) is None

    members.drain(d100)
    gone = members.pop(d100)  # drained, and let go of
    assert gone is workers["d-100"] and members.get(d100) is None and len(members) == 2
    assert not members.any_draining() and members.role(d100) is None
    assert members.limits().max_steps == 50


async def test_one_member_as_get_status_shows_it_and_an_unknown_address(pool) -> None:
    members, workers = pool
    d50 = workers["d-50"]
    d50.health, d50.progress = WorkerHealth.SERVING, (3, 9)
    assert members.role(d50.address) is DENOISER and members.health(d50.address) is WorkerHealth.SERVING
    assert members.progress(d50.address) == (3, 9)
    unknown = "10.0.0.9:1"
    assert members.role(unknown) is None and members.health(unknown) is WorkerHealth.UNKNOWN
    assert members.progress(unknown) == (0, 0) and members.health_detail(unknown) == ""
    assert members.build(unknown) == common_pb2.BuildInfo() and members.platform(unknown).device == ""
