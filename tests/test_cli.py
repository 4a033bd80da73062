"""`glmimage` CLI, run as a real subprocess against the scripted gateway (tests/support/fake_gateway.py)."""
from __future__ import annotations

import argparse
import json
import re
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from glmimage.cli import build_parser, format_limits, format_status, main
from glmimage.client import build_request
from glmimage.results import Limits, Status, WorkerInfo
from glmimage.v1 import common_pb2, gateway_service_pb2
from tests.support.certs import Pki
from tests.support.fake_gateway import FakeServer, fake_image, serve_fake
from tests.support.fake_lora_gateway import ADMIN_KEY, BROKEN, DENOISERS, sent_loras, serve_fake_loras
from tests.support.programs import glmimage


def test_generate_writes_images_and_prints_usage(fake: FakeServer, tmp_path: Path) -> None:
    out = glmimage("generate", "a red sign", "-n", "2", "--size", "512x512", "-o", "out/", "--seed", "4",
                   "--address", fake.address, cwd=tmp_path, env={"GLMIMAGE_API_KEY": "sk-env"})
    assert out.returncode == 0, out.stderr
    files = sorted((tmp_path / "out").iterdir())
    assert [f.name for f in files] == ["image-0.png", "image-1.png"]
    assert [f.read_bytes() for f in files] == [fake_image("a red sign", i, 4 + i) for i in range(2)]
    per_image = (512 // 16) * (512 // 16) + 1
    usage = re.search(r"usage: prompt_tokens=(\d+) completion_tokens=(\d+) total_tokens=(\d+)", out.stdout)
    assert usage, out.stdout
    assert [int(g) for g in usage.groups()] == [2 * 3, 2 * per_image, 2 * 3 + 2 * per_image]
    assert "out/image-1.png" in out.stdout and "seed 5" in out.stdout
    (call,) = fake.servicer.calls
    assert call.metadata["authorization"] == "Bearer sk-env"
    assert (call.request.n, call.request.width, call.request.height) == (2, 512, 512)


def test_generate_json_output_and_format(fake: FakeServer, tmp_path: Path) -> None:
    out = glmimage("generate", "p", "--format", "jpeg", "--name", "pic", "-o", str(tmp_path / "o"), "--json",
                   "--address", fake.address, "--api-key", "sk-flag", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["files"] == [str(tmp_path / "o" / "pic-0.jpg")]
    assert doc["output_format"] == "jpeg" and doc["seeds"] == [1000]
    assert doc["usage"]["completion_tokens"] == (256 // 16) ** 2 + 1
    assert Path(doc["files"][0]).read_bytes() == fake_image("p", 0, 1000, fake.servicer.calls[0].request.output_format)
    assert fake.servicer.calls[0].metadata["authorization"] == "Bearer sk-flag"


def test_stream_shows_a_progress_bar_and_writes_partials(fake: FakeServer, tmp_path: Path) -> None:
    out = glmimage("generate", "p", "-n", "2", "--steps", "5", "--stream", "--partial-images", "1", "-o", "s",
                   "--address", fake.address, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    frames = out.stderr.strip().split("\r")
    assert len([f for f in frames if f]) == 10  # one redraw per denoising step of each image
    assert frames[-1].startswith("[" + "#" * 30 + "] 100%") and "10/10 steps" in frames[-1]
    assert re.search(r"\] +50%", out.stderr)
    names = sorted(p.name for p in (tmp_path / "s").iterdir())
    assert names == ["image-0.partial-0.png", "image-0.png", "image-1.partial-0.png", "image-1.png"]
    assert (tmp_path / "s" / "image-1.partial-0.png").read_bytes() == b"partial:1:0"
    assert "usage: prompt_tokens=2 " in out.stdout
    assert fake.servicer.methods() == ["GenerateImagesStream"]


def test_status_prints_queues_and_workers(fake: FakeServer, tmp_path: Path) -> None:
    out = glmimage("status", "--address", fake.address, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert re.fullmatch(r"pending denoise outputs +3", next(ln for ln in lines if ln.startswith("pending denoise")))
    header = next(ln for ln in lines if ln.startswith("ROLE"))
    assert header.split() == ["ROLE", "ADDRESS", "STATE", "INFLIGHT", "JOB", "LORAS"]
    rows = [ln.split() for ln in lines[lines.index(header) + 1:]]
    assert rows == [["ar", "10.0.0.1:50051", "available", "0", "-", "-"],
                    ["denoiser", "10.0.0.2:50061", "busy", "1", "req-1/0#1", "-"]]
    as_json = json.loads(glmimage("status", "--json", "--address", fake.address, cwd=tmp_path).stdout)
    assert as_json["active_requests"] == 4 and as_json["workers"][1]["current_job"] == "req-1/0#1"


def test_status_without_the_admin_role_lists_workers_by_position() -> None:
    # What a gateway shows a caller without the admin role: no addresses, and no ids of other callers' jobs.
    status = Status(0, 0, 0, 2, [WorkerInfo("", "ar", "busy", 1, ""), WorkerInfo("", "denoiser", "busy", 1, ""),
                                 WorkerInfo("", "denoiser", "busy", 1, "mine/0#1"),
                                 WorkerInfo("", "denoiser", "busy", 0, "", held_elsewhere=True),
                                 WorkerInfo("", "denoiser", "unhealthy", 0, "",
                                            health="refuses the gateway's credential")])
    lines = format_status(status).splitlines()
    header = next(ln for ln in lines if ln.startswith("ROLE"))
    # The JOB column may hold spaces; LORAS, the last, never does.
    assert [[*ln.split(maxsplit=4)[:4], *ln.split(maxsplit=4)[4].rsplit(maxsplit=1)]
            for ln in lines[lines.index(header) + 1:]] == [
        ["ar", "#0", "busy", "1", "-", "-"], ["denoiser", "#1", "busy", "1", "(another caller's)", "-"],
        ["denoiser", "#2", "busy", "1", "mine/0#1", "-"], ["denoiser", "#3", "busy", "0", "(another gateway's)", "-"],
        ["denoiser", "#4", "unhealthy", "0", "-", "-"]]


def test_status_shows_each_tenant_with_its_queues_and_quotas() -> None:
    status = Status.from_proto(gateway_service_pb2.GetStatusResponse(tenants=[
        gateway_service_pb2.TenantStatus(name="alpha", weight=1, pending_ar_requests=2, active_requests=3,
                                         inflight_images=3, oldest_wait_seconds=12.34,
                                         max_priority=gateway_service_pb2.PRIORITY_INTERACTIVE),
        gateway_service_pb2.TenantStatus(name="beta", weight=2.5, pending_denoise_outputs=4, inflight_images=4,
                                         max_inflight_images=8, requests_per_minute=30, remaining_requests=27,
                                         images_per_minute=60, remaining_images=50)]))
    assert [t.max_priority for t in status.tenants] == ["interactive", "default"]
    lines = format_status(status).splitlines()
    header = next(ln for ln in lines if ln.startswith("TENANT"))
    assert [ln.split() for ln in lines[lines.index(header) + 1:]] == [
        ["alpha", "1", "2", "0", "3", "3", "12.3s", "-", "-"],
        ["beta", "2.5", "0", "4", "0", "4/8", "0.0s", "27/30", "50/60"]]
    assert "TENANT" not in format_status(Status(0, 0, 0, 0))  # a gateway that shows none: no table


def test_errors_exit_non_zero_without_retrying_bad_input(fake: FakeServer, tmp_path: Path) -> None:
    out = glmimage("generate", "invalid", "--address", fake.address, cwd=tmp_path)
    assert out.returncode == 1
    assert "INVALID_ARGUMENT: prompt: not allowed" in out.stderr
    assert len(fake.servicer.calls) == 1
    assert not list(tmp_path.glob("*.png"))


def test_retries_flag(fake: FakeServer, tmp_path: Path) -> None:
    fake.servicer.fail["GetStatus"] = [grpc.StatusCode.UNAVAILABLE] * 3
    out = glmimage("status", "--retries", "1", "--address", fake.address, cwd=tmp_path)
    assert out.returncode == 1 and "UNAVAILABLE" in out.stderr
    assert len(fake.servicer.calls) == 2
    out = glmimage("status", "--retries", "3", "--address", fake.address, cwd=tmp_path)
    assert out.returncode == 0, out.stderr


def test_bad_size_is_a_usage_error(fake: FakeServer, tmp_path: Path) -> None:
    out = glmimage("generate", "p", "--size", "big", "--address", fake.address, cwd=tmp_path)
    assert out.returncode == 2 and "size must be WIDTHxHEIGHT" in out.stderr
    assert fake.servicer.calls == []


def test_mutual_tls_flags(pki: Pki, tmp_path: Path) -> None:
    with serve_fake(pki.server_credentials(mutual=True)) as srv:
        out = glmimage("status", "--address", srv.address, "--tls-ca", str(pki.ca),
                       "--tls-cert", str(pki.client_cert), "--tls-key", str(pki.client_key), cwd=tmp_path)
        assert out.returncode == 0, out.stderr
        assert "pending AR outputs" in out.stdout
        out = glmimage("status", "--address", srv.address, "--tls-ca", str(pki.ca), "--retries", "0",
                       "--timeout", "10", cwd=tmp_path)
        assert out.returncode == 1 and "UNAVAILABLE" in out.stderr


def test_connection_flags_go_before_or_after_the_subcommand(fake: FakeServer, tmp_path: Path) -> None:
    before = glmimage("--address", fake.address, "--api-key", "sk-before", "--json", "status", cwd=tmp_path)
    assert before.returncode == 0, before.stderr
    assert json.loads(before.stdout)["active_requests"] == 4
    assert fake.servicer.calls[-1].metadata["authorization"] == "Bearer sk-before"
    # Given in both places, the value after the subcommand wins; one given only before it stands.
    both = glmimage("--address", "127.0.0.1:1", "--api-key", "sk-before", "--timeout", "20", "status",
                    "--address", fake.address, "--api-key", "sk-after", cwd=tmp_path)
    assert both.returncode == 0, both.stderr
    assert "pending AR outputs" in both.stdout
    assert fake.servicer.calls[-1].metadata["authorization"] == "Bearer sk-after"
    out = glmimage("--retries", "0", "--timeout", "10", "--address", fake.address, "generate", "p", "-o", "g",
                   cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "g" / "image-0.png").exists()
    fake.servicer.fail["GetStatus"] = [grpc.StatusCode.UNAVAILABLE]
    out = glmimage("--retries", "0", "status", "--address", fake.address, cwd=tmp_path)
    assert out.returncode == 1 and "UNAVAILABLE" in out.stderr


def test_generate_sends_the_step_cache_and_refuses_an_unknown_one(fake: FakeServer, tmp_path: Path) -> None:
    done = glmimage("generate", "a fox", "--step-cache", "balanced", "-o", "out", "--address", fake.address,
                    cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    (call,) = fake.servicer.calls
    assert call.request.step_cache == common_pb2.STEP_CACHE_BALANCED
    bad = glmimage("generate", "a fox", "--step-cache", "fast", "--address", fake.address, cwd=tmp_path)
    assert bad.returncode == 2 and "--step-cache" in bad.stderr
    with pytest.raises(ValueError, match="step_cache must be one of off, balanced, aggressive"):
        build_request("a fox", step_cache="fast")
    assert build_request("a fox").step_cache == common_pb2.STEP_CACHE_UNSPECIFIED


def test_limits_print_integers_in_full() -> None:
    limits = Limits(max_prompt_chars=8192, max_n=10, max_pixels=4194304, max_steps=200,
                    max_guidance=30.010000228881836, max_batch_outputs=32, max_partial_images=3,
                    max_reference_images=16, max_reference_bytes=8388608, max_reference_total_bytes=33554432,
                    max_reference_pixels=16777216, step_cache=True)
    rows = dict(line.split() for line in format_limits(limits).splitlines()[1:])
    assert rows["max_reference_bytes"] == "8388608" and rows["max_pixels"] == "4194304"
    assert rows["step_cache"] == "yes"
    assert rows["max_guidance"] == "30.01"  # a float32 on the wire, shown as it was set


def test_existing_files_are_not_overwritten_without_force(fake: FakeServer, tmp_path: Path) -> None:
    first = glmimage("generate", "one", "-o", "out", "--seed", "1", "--address", fake.address, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    kept = (tmp_path / "out" / "image-0.png").read_bytes()
    again = glmimage("generate", "two", "-o", "out", "--address", fake.address, cwd=tmp_path)
    assert again.returncode == 1
    assert "out/image-0.png exists; --force overwrites, or choose another -o or --name" in again.stderr
    assert len(fake.servicer.calls) == 1  # refused before the request: nothing generated for nothing
    assert (tmp_path / "out" / "image-0.png").read_bytes() == kept
    forced = glmimage("generate", "two", "-o", "out", "--seed", "1", "--force", "--address", fake.address,
                      cwd=tmp_path)
    assert forced.returncode == 0, forced.stderr
    assert (tmp_path / "out" / "image-0.png").read_bytes() == fake_image("two", 0, 1)


def test_help_shows_every_default(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    top = {a.dest: a.default for a in parser._actions}
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    for p in [parser, *commands.choices.values()]:
        for a in p._actions:
            # The subcommands' copies of the connection flags default to SUPPRESS: the top-level default counts.
            default = top.get(a.dest) if a.default == argparse.SUPPRESS else a.default
            if a.option_strings and a.nargs != 0 and default is not None:
                assert "default" in (a.help or ""), f"{p.prog} {a.option_strings[0]}: {a.help!r}"
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert "(default 1)" in shown and "(default 600)" in shown and "(default: the current one)" in shown


# --- LoRA adapters (the scripted gateway of tests/support/fake_lora_gateway.py) -------------------------------------


@pytest.fixture()
def lora_gw() -> Iterator[FakeServer]:
    with serve_fake_loras() as srv:
        yield srv


def test_generate_and_edit_send_each_lora(lora_gw: FakeServer, tmp_path: Path) -> None:
    done = glmimage("generate", "a fox", "--lora", "tiny-style:0.5", "--lora", "ink", "-o", "out",
                    "--address", lora_gw.address, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert sent_loras(lora_gw) == [("tiny-style", 0.5), ("ink", None)]
    assert (tmp_path / "out" / "image-0.png").read_bytes() == b"PNG:a fox:tiny-style=0.5,ink=-"
    (tmp_path / "ref.png").write_bytes(b"\x89PNG\r\n\x1a\nref")
    done = glmimage("edit", "ref.png", "-p", "blue", "--size", "64x64", "--lora", "ink:-1", "--stream", "-o", "e",
                    "--address", lora_gw.address, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert lora_gw.servicer.calls[-1].method == "GenerateImagesStream"
    assert sent_loras(lora_gw) == [("ink", -1.0)]
    done = glmimage("generate", "a fox", "-o", "plain", "--address", lora_gw.address, cwd=tmp_path)
    assert done.returncode == 0 and sent_loras(lora_gw) == []


@pytest.mark.parametrize("value", ["", ":1", "ink:", "ink:strong", "ink:1:2", "ink:nan"])
def test_a_malformed_lora_is_a_usage_error_naming_the_flag(lora_gw: FakeServer, tmp_path: Path,
                                                           value: str) -> None:
    for command in (["generate", "a fox"], ["edit", "ref.png", "-p", "blue"]):
        done = glmimage(*command, "--lora", value, "--address", lora_gw.address, cwd=tmp_path)
        assert done.returncode == 2, done.stderr
        assert f"argument --lora: {value!r} is not NAME[:SCALE]" in done.stderr
    assert lora_gw.servicer.calls == []


def test_an_unknown_lora_is_the_gateways_error_naming_loras(lora_gw: FakeServer, tmp_path: Path) -> None:
    done = glmimage("generate", "a fox", "--lora", "nope", "--address", lora_gw.address, cwd=tmp_path)
    assert done.returncode == 1
    assert "glmimage: error: INVALID_ARGUMENT: loras[0]: unknown LoRA adapter 'nope'" in done.stderr
    assert not list(tmp_path.glob("*.png"))


def test_loras_list_as_a_table_and_as_json(lora_gw: FakeServer, tmp_path: Path) -> None:
    done = glmimage("loras", "list", "--address", lora_gw.address, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].split() == ["NAME", "DEFAULT_SCALE", "BYTES", "DESCRIPTION"]
    assert lines[1].split(maxsplit=3) == ["tiny-style", "1", "12345", "a demo style"]
    assert lines[2].split() == ["ink", "0.75", "2048"]
    assert "WORKER" not in done.stdout  # placement is the admin role's
    admin = glmimage("--api-key", ADMIN_KEY, "loras", "list", "--address", lora_gw.address, cwd=tmp_path)
    assert admin.returncode == 0, admin.stderr
    tail = admin.stdout.splitlines()[4:]
    assert [ln.split() for ln in tail] == [["WORKER", "LOADED", "ERROR"], [DENOISERS[0], "tiny-style", "-"],
                                           [DENOISERS[1], "-", "-"]]
    doc = json.loads(glmimage("loras", "list", "--json", "--api-key", ADMIN_KEY, "--address", lora_gw.address,
                              cwd=tmp_path).stdout)
    assert doc["loras"][0] == {"name": "tiny-style", "description": "a demo style", "default_scale": 1.0,
                               "size_bytes": 12345}
    assert doc["placement"][0] == {"worker": DENOISERS[0], "loaded": ["tiny-style"], "error": ""}


def test_loras_load_and_unload(lora_gw: FakeServer, tmp_path: Path) -> None:
    admin = ("--api-key", ADMIN_KEY, "--address", lora_gw.address)
    done = glmimage("loras", "load", "ink", "tiny-style", "--worker", DENOISERS[1], *admin, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    request = lora_gw.servicer.calls[-1].request
    assert (list(request.names), list(request.workers)) == (["ink", "tiny-style"], [DENOISERS[1]])
    assert [ln.split() for ln in done.stdout.splitlines()] == [["WORKER", "LOADED", "ERROR"],
                                                              [DENOISERS[1], "ink,tiny-style", "-"]]
    done = glmimage("loras", "unload", "tiny-style", "--json", *admin, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert list(lora_gw.servicer.calls[-1].request.workers) == []
    assert json.loads(done.stdout) == [{"worker": DENOISERS[0], "loaded": [], "error": ""},
                                       {"worker": DENOISERS[1], "loaded": ["ink"], "error": ""}]
    status = glmimage("status", *admin, cwd=tmp_path)
    assert [ln.split()[-1] for ln in status.stdout.splitlines() if ln.startswith("denoiser")] == ["-", "ink"]
    # A denoiser that could not: its row says why, stderr too, and the exit code is 1.
    done = glmimage("loras", "load", "ink", "--worker", DENOISERS[0], "--worker", BROKEN, *admin, cwd=tmp_path)
    assert done.returncode == 1
    assert f"glmimage: error: {BROKEN}: UNAVAILABLE: the denoiser is not reachable" in done.stderr
    assert done.stdout.splitlines()[1].split() == [DENOISERS[0], "ink", "-"]
    # Without the admin role, or with an unknown name: the gateway's refusal.
    done = glmimage("loras", "unload", "ink", "--retries", "0", "--address", lora_gw.address, cwd=tmp_path)
    assert done.returncode == 1 and "PERMISSION_DENIED" in done.stderr
    done = glmimage("loras", "load", "nope", *admin, cwd=tmp_path)
    assert done.returncode == 1 and "INVALID_ARGUMENT: names[0]" in done.stderr
    usage = glmimage("loras", "load", *admin, cwd=tmp_path)
    assert usage.returncode == 2 and "NAME" in usage.stderr


def test_status_shows_each_denoisers_loras() -> None:
    status = Status(0, 0, 0, 0, [WorkerInfo("a:1", "ar", "available", 0, ""),
                                 WorkerInfo("d:1", "denoiser", "available", 0, "", loras_loaded=["x", "y"])])
    rows = format_status(status).splitlines()[-2:]
    assert [r.split()[-1] for r in rows] == ["-", "x,y"]
