"""The chart's defaults for a rolling update with nothing lost (issue 32): every Deployment surges one pod and keeps
every old one until its replacement is ready (maxSurge 1, maxUnavailable 0; the SQLite-jobs gateway excepted, which
must stop first), every container sleeps in preStop before its SIGTERM (Services and DNS stop sending it work), and
the grace period covers that sleep plus the drain; the REST front drains as long as its gateway."""
from __future__ import annotations

import pytest

from tests.support.chart import by_kind, container, documented_values, pod_spec, render

ROLES = {"ar": ("ar",), "denoiser": ("denoiser",), "gateway": ("gateway", "rest")}


def _flag(c: dict, name: str) -> str | None:
    return next((a.split("=", 1)[1] for a in c["args"] if a.startswith(f"--{name}=")), None)


@pytest.mark.parametrize("deployment", sorted(ROLES))
def test_every_role_rolls_surge_first(default_docs: list[dict], deployment: str) -> None:
    dep = by_kind(default_docs, "Deployment")[f"demo-glmimage-{deployment}"]
    assert dep["spec"]["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}


@pytest.mark.parametrize("name", sorted(documented_values()))
def test_every_container_sleeps_before_sigterm_and_its_grace_covers_the_drain(name: str) -> None:
    docs = render(documented_values()[name])
    for deployment, containers in ROLES.items():
        spec = pod_spec(docs, deployment)
        present = {x["name"] for x in spec["containers"]}
        for c in (container(docs, deployment, n) for n in containers if n in present):
            sleep = c["lifecycle"]["preStop"]["sleep"]["seconds"]
            drain = float(_flag(c, "drain-seconds"))
            assert sleep > 0 and spec["terminationGracePeriodSeconds"] > sleep + drain, (deployment, c["name"])


def test_the_rest_front_drains_as_long_as_its_gateway(default_docs: list[dict]) -> None:
    assert _flag(container(default_docs, "gateway", "rest"), "drain-seconds") == \
        _flag(container(default_docs, "gateway", "gateway"), "drain-seconds")


def test_a_grace_period_shorter_than_the_drain_is_refused() -> None:
    with pytest.raises(Exception, match="must exceed preStopSeconds"):
        render({"denoiser": {"drainSeconds": 200}})


def test_the_sqlite_jobs_gateway_still_stops_first() -> None:
    docs = render({"jobs": {"enabled": True, "db": {"allowLocal": True}}, "gateway": {"replicas": 1}})
    strategy = by_kind(docs, "Deployment")["demo-glmimage-gateway"]["spec"]["strategy"]
    assert strategy["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}


