"""Where the AR runs: devices, checkpoint layouts, and the external srt backend (against a local HTTP stand-in)."""
from __future__ import annotations

import importlib.util
import json
import random
import shutil
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import grpc
import pytest
import torch

from glmimage.v1 import ar_service_pb2 as pb
from glmimage.v1 import ar_service_pb2_grpc, common_pb2
from services.ar.domain import ArRequest
from services.model.device import DeviceUnavailable, device_name, resolve_device
from tests.support.servers import serve_ar

HAS_CUDA = torch.cuda.is_available()
HAS_TORCH_NPU = importlib.util.find_spec("torch_npu") is not None


# --- devices ---

def test_cpu_is_selected_explicitly() -> None:
    assert resolve_device("cpu") == torch.device("cpu")


def test_a_device_is_named_with_its_index_as_getlimits_says_it() -> None:
    assert device_name(torch.device("cpu")) == "cpu"
    assert device_name(torch.device("cuda", 1)) == "cuda:1"  # (no GPU needed: the index is given)


@pytest.mark.skipif(not HAS_CUDA, reason="no GPU here")
def test_cuda_without_an_index_is_named_by_the_current_device() -> None:
    assert device_name(resolve_device("cuda")) == f"cuda:{torch.cuda.current_device()}"


@pytest.mark.skipif(HAS_CUDA or HAS_TORCH_NPU, reason="an accelerator is present: auto would pick it")
def test_auto_picks_cpu_without_accelerators() -> None:
    assert resolve_device("auto") == torch.device("cpu")


@pytest.mark.skipif(HAS_CUDA, reason="CUDA is available here")
def test_cuda_unavailable_is_a_clear_error_before_any_weights_load(tmp_path: Path) -> None:
    from services.ar.engine import ArEngine

    with pytest.raises(DeviceUnavailable, match="--device cuda: CUDA is not available"):
        ArEngine.load(tmp_path / "no-checkpoint-needed", device="cuda")


@pytest.mark.skipif(HAS_TORCH_NPU, reason="torch_npu is installed here")
def test_npu_without_torch_npu_is_a_clear_error(tmp_path: Path) -> None:
    from services.ar.engine import ArEngine

    with pytest.raises(DeviceUnavailable, match="--device npu: the torch_npu package is not installed"):
        ArEngine.load(tmp_path / "no-checkpoint-needed", device="npu")


@pytest.mark.skipif(HAS_TORCH_NPU, reason="torch_npu is installed here")
async def test_the_server_exits_with_the_device_message_not_a_traceback() -> None:
    from services.ar.__main__ import parse_args, run

    with pytest.raises(SystemExit) as exc:
        await run(parse_args(["--port", "0", "--device", "npu"]))
    assert "torch_npu package is not installed" in str(exc.value.code)


def test_srt_backend_needs_a_url() -> None:
    from services.ar.__main__ import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--backend", "srt"])
    assert parse_args(["--backend", "srt", "--srt-url", "http://127.0.0.1:1"]).srt_url == "http://127.0.0.1:1"


# --- checkpoint layouts ---

@pytest.fixture(scope="module")
def bare_ar_dir(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Just the two subfolders the AR needs, copied out of the full tiny checkpoint."""
    bare = tmp_path_factory.mktemp("bare-ar")
    for part in ("processor", "vision_language_encoder"):
        shutil.copytree(tiny_checkpoint / part, bare / part)
    return bare


def test_a_bare_processor_plus_encoder_directory_loads_and_matches_the_full_layout(bare_ar_dir, ar_engine) -> None:
    from services.ar.engine import ArEngine

    req = ArRequest(prompt="bare layout", n=1, height=64, width=64, seed=9)
    bare = ArEngine.load(bare_ar_dir, device="cpu")
    assert bare.generate([req]) == ar_engine.generate([req])


def test_a_directory_without_the_encoder_names_what_is_missing(tmp_path: Path, tiny_checkpoint: Path) -> None:
    from services.ar.engine import ArEngine
    from services.model.loading import CheckpointError

    shutil.copytree(tiny_checkpoint / "processor", tmp_path / "processor")
    with pytest.raises(CheckpointError, match="vision_language_encoder"):
        ArEngine.load(tmp_path, device="cpu")


# --- the srt backend against a stand-in sglang-style /generate server ---

EOS = 129  # the tiny tokenizer's image end token


@dataclass
class StandIn:
    """Speaks the sglang /generate JSON: list-valued text and sampling_params in, a list of results out.

    Each output row is random visual ids from the row's sampling_seed, ending with the end token. It reports a
    prefix cache: the second and later rows with the same text have all but one prompt token cached."""

    url: str = ""
    bodies: list[dict] = field(default_factory=list)
    status: int = 200
    short: bool = False
    seen: set[str] = field(default_factory=set)

    def answer(self, body: dict) -> list[dict]:
        out = []
        for text, sp in zip(body["text"], body["sampling_params"], strict=True):
            rng = random.Random(sp["sampling_seed"])
            length = sp["max_new_tokens"] - (10 if self.short else 0)
            ids = [rng.randrange(128) for _ in range(length - 1)] + [EOS]
            prompt_tokens = 40 + len(text) % 7
            cached = prompt_tokens - 1 if text in self.seen else 0
            self.seen.add(text)
            out.append({"text": "", "output_ids": ids, "meta_info": {
                "prompt_tokens": prompt_tokens, "completion_tokens": len(ids), "cached_tokens": cached}})
        return out


@pytest.fixture(scope="module")
def stand_in() -> Iterator[StandIn]:
    state = StandIn()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's naming
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            state.bodies.append(body)
            if self.path != "/generate" or state.status != 200:
                self.send_response(404 if self.path != "/generate" else state.status)
                self.end_headers()
                return
            data = json.dumps(state.answer(body)).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args) -> None:  # keep test output clean
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    state.url = f"http://127.0.0.1:{server.server_address[1]}"
    yield state
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
async def srt_ar(bare_ar_dir: Path, stand_in: StandIn):
    """A real ArService whose backend forwards to the stand-in; loads only the processor."""
    from runtime.executor import SerialExecutor
    from services.ar.srt_backend import SrtBackend

    backend = SrtBackend.load(bare_ar_dir, stand_in.url, timeout=10)
    backend.warm_up()
    executor = SerialExecutor("test-ar-srt")
    server = await serve_ar(backend, executor)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        yield backend, ar_service_pb2_grpc.ArServiceStub(channel)
    await server.stop(None)
    executor.shutdown()


async def test_srt_batch_sends_one_request_and_takes_usage_from_meta_info(srt_ar, stand_in: StandIn) -> None:
    backend, ar = srt_ar
    stand_in.bodies.clear()
    reqs = [pb.GenerateRequest(prompt="first prompt", n=2, height=64, width=64, seed=5),
            pb.GenerateRequest(prompt="second", n=1, height=64, width=64, seed=50,
                               sampling=common_pb2.SamplingParams(temperature=0.5, top_k=7))]
    resp = await ar.GenerateBatch(pb.GenerateBatchRequest(requests=reqs))

    (body,) = stand_in.bodies  # one HTTP call for the whole batch, one entry per output row
    enc = backend.prompts.encode("first prompt", 64, 64)
    assert body["text"][0] == body["text"][1] == backend.prompts.text(enc)
    tok = backend.prompts.processor.tokenizer
    assert tok(body["text"][0], add_special_tokens=False).input_ids == enc.input_ids  # the exact model input
    assert [sp["sampling_seed"] for sp in body["sampling_params"]] == [5, 6, 50]
    assert {sp["max_new_tokens"] for sp in body["sampling_params"]} == {16 * 16 + 2 * 2 + 1}
    assert "temperature" not in body["sampling_params"][0]  # unset: the server's model defaults
    assert body["sampling_params"][2]["temperature"] == pytest.approx(0.5)
    assert body["sampling_params"][2]["top_k"] == 7

    first, second = resp.responses
    assert [o.seed for o in first.outputs] == [5, 6] and [o.seed for o in second.outputs] == [50]
    expected = stand_in.answer({"text": body["text"][:1], "sampling_params": body["sampling_params"][:1]})[0]
    large = expected["output_ids"][256:260]  # after the 16x16 preview: the 2x2 grid, upsampled 2x
    assert list(first.outputs[0].tokens.token_ids) == [large[0], large[0], large[1], large[1]] * 2 + \
        [large[2], large[2], large[3], large[3]] * 2
    # Usage is the server's: the repeated prompt hit its prefix cache.
    u0, u1 = first.outputs[0].usage, first.outputs[1].usage
    assert u0.prompt_tokens == u1.prompt_tokens == 40 + len(body["text"][0]) % 7
    assert u1.cached_tokens == u1.prompt_tokens - 1 > 0
    assert u0.completion_tokens == 16 * 16 + 2 * 2 + 1
    assert first.usage.cached_tokens == u0.cached_tokens + u1.cached_tokens
    assert first.usage.total_tokens == first.usage.prompt_tokens + first.usage.completion_tokens


async def test_an_srt_backed_ar_says_another_server_runs_its_model(srt_ar) -> None:
    _, ar = srt_ar
    assert (await ar.GetLimits(pb.ArServiceGetLimitsRequest())).device == "srt"


async def test_srt_backend_errors_map_to_statuses(srt_ar, stand_in: StandIn) -> None:
    _, ar = srt_ar
    req = pb.GenerateRequest(prompt="x", height=64, width=64, seed=1)
    stand_in.status = 500
    try:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await ar.Generate(req)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        stand_in.status = 200
    stand_in.short = True
    try:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await ar.Generate(req)
        assert err.value.code() == grpc.StatusCode.INTERNAL
        assert "stopped after" in err.value.details()
    finally:
        stand_in.short = False
    with pytest.raises(grpc.aio.AioRpcError) as err:  # validation happens here, before any HTTP call
        await ar.Generate(pb.GenerateRequest(prompt="", height=64, width=64))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details().startswith("prompt:")


def test_srt_backend_unreachable_is_unavailable(bare_ar_dir: Path) -> None:
    import socket

    from runtime.errors import Unavailable
    from services.ar.srt_backend import SrtBackend

    with socket.socket() as s:  # a port nothing listens on once closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    backend = SrtBackend.load(bare_ar_dir, f"http://127.0.0.1:{port}", timeout=5)
    with pytest.raises(Unavailable, match="unreachable"):
        backend.generate([ArRequest(prompt="x", n=1, height=64, width=64, seed=1)])
