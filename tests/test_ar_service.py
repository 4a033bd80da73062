"""ArService on the tiny real model, over a real gRPC server."""
from __future__ import annotations

import grpc
import pytest

from glmimage.v1 import ar_service_pb2 as pb
from glmimage.v1 import ar_service_pb2_grpc, common_pb2

PROMPT = 'a red "STOP" sign'


@pytest.fixture
async def ar(ar_server):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{ar_server.port}") as channel:
        yield ar_service_pb2_grpc.ArServiceStub(channel)


async def test_generate_returns_n_rows_with_usage(ar, ar_engine) -> None:
    resp = await ar.Generate(pb.GenerateRequest(prompt=PROMPT, n=2, height=256, width=256, seed=7))
    assert len(resp.outputs) == 2
    assert (resp.grid_height, resp.grid_width) == (16, 16)
    assert [o.seed for o in resp.outputs] == [7, 8]
    # The real tokenized prompt length, template included.
    enc = ar_engine._encode(PROMPT, 256, 256)
    prompt_tokens = int(enc["attention_mask"].sum())
    for out in resp.outputs:
        assert len(out.tokens.token_ids) == 16 * 16
        assert all(0 <= t < 128 for t in out.tokens.token_ids)
        # 256x256: 16x16 preview + 8x8 large grid + end token.
        assert out.usage.completion_tokens == 16 * 16 + 8 * 8 + 1
        assert out.usage.prompt_tokens == prompt_tokens
        assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
        assert out.usage.cached_tokens == 0 and out.usage.reasoning_tokens == 0
    assert resp.usage.completion_tokens == 2 * (16 * 16 + 8 * 8 + 1)
    assert resp.usage.prompt_tokens == 2 * prompt_tokens


async def test_same_seed_same_tokens_and_output_i_uses_seed_plus_i(ar) -> None:
    a = await ar.Generate(pb.GenerateRequest(prompt=PROMPT, n=2, height=128, width=128, seed=100))
    b = await ar.Generate(pb.GenerateRequest(prompt=PROMPT, n=1, height=128, width=128, seed=101))
    c = await ar.Generate(pb.GenerateRequest(prompt=PROMPT, n=2, height=128, width=128, seed=100))
    assert a.outputs[1].tokens.token_ids == b.outputs[0].tokens.token_ids
    assert a == c
    assert a.outputs[0].tokens.token_ids != a.outputs[1].tokens.token_ids


async def test_unseeded_request_reports_its_random_seed(ar) -> None:
    resp = await ar.Generate(pb.GenerateRequest(prompt=PROMPT, height=64, width=64))
    replay = await ar.Generate(pb.GenerateRequest(prompt=PROMPT, height=64, width=64, seed=resp.outputs[0].seed))
    assert replay.outputs[0].tokens == resp.outputs[0].tokens


async def test_sizes_round_up_to_multiples_of_32(ar) -> None:
    resp = await ar.Generate(pb.GenerateRequest(prompt=PROMPT, height=200, width=250, seed=1))
    assert (resp.height, resp.width) == (224, 256)
    assert (resp.grid_height, resp.grid_width) == (14, 16)
    assert len(resp.outputs[0].tokens.token_ids) == 14 * 16


async def test_batch_returns_one_response_per_request(ar) -> None:
    reqs = [pb.GenerateRequest(prompt=p, n=n, height=64, width=64, seed=5) for p, n in (("a", 1), ("a longer one", 2))]
    resp = await ar.GenerateBatch(pb.GenerateBatchRequest(requests=reqs))
    assert [len(r.outputs) for r in resp.responses] == [1, 2]
    alone = await ar.Generate(reqs[1])
    assert resp.responses[1] == alone


@pytest.mark.parametrize("request_, field", [
    (pb.GenerateRequest(prompt="", height=64, width=64), "prompt"),
    (pb.GenerateRequest(prompt="   ", height=64, width=64), "prompt"),
    (pb.GenerateRequest(prompt="x" * 9000, height=64, width=64), "prompt"),
    (pb.GenerateRequest(prompt="x", n=17, height=64, width=64), "n"),
    (pb.GenerateRequest(prompt="x", height=0, width=64), "height"),
    (pb.GenerateRequest(prompt="x", height=64, width=0), "width"),
    (pb.GenerateRequest(prompt="x", height=4096, width=4096), "height"),
    (pb.GenerateRequest(prompt="x", height=64, width=64,
                        sampling=common_pb2.SamplingParams(temperature=0)), "sampling.temperature"),
    (pb.GenerateRequest(prompt="x", height=64, width=64,
                        sampling=common_pb2.SamplingParams(top_p=1.5)), "sampling.top_p"),
])
async def test_invalid_requests_name_the_field(ar, request_, field) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await ar.Generate(request_)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(f"{field}:")


async def test_batch_with_mixed_sizes_is_rejected(ar) -> None:
    reqs = [pb.GenerateRequest(prompt="a", height=64, width=64), pb.GenerateRequest(prompt="b", height=128, width=64)]
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await ar.GenerateBatch(pb.GenerateBatchRequest(requests=reqs))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "requests" in err.value.details()


async def test_batch_errors_name_the_request_index(ar) -> None:
    reqs = [pb.GenerateRequest(prompt="a", height=64, width=64), pb.GenerateRequest(prompt="", height=64, width=64)]
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await ar.GenerateBatch(pb.GenerateBatchRequest(requests=reqs))
    assert err.value.details().startswith("requests[1].prompt:")
