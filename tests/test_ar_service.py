"""ArService on the tiny real model, over a real gRPC server: batching, determinism, usage, validation, metrics."""
from __future__ import annotations

import shutil
import subprocess

import grpc
import pytest
import torch
from prometheus_client import REGISTRY, generate_latest

from glmimage.v1 import ar_service_pb2 as pb
from glmimage.v1 import ar_service_pb2_grpc, common_pb2
from runtime.executor import SerialExecutor
from tests.support.servers import serve_ar

PROMPT = 'a red "STOP" sign'
# Three prompts of clearly different tokenized lengths, so the batch really is left-padded.
BATCH_PROMPTS = ["a", 'a red "STOP" sign on a long, winding country road at dusk, with "SLOW" painted on it',
                 "three cats asleep"]
BATCH_SEEDS = [10, 20, 30]
# 256x256: a 16x16 preview grid, the 8x8 large grid, then the end token.
COMPLETION_256 = 16 * 16 + 8 * 8 + 1


@pytest.fixture(scope="module")
async def ar_stack(ar_engine):
    """A real ArService on 127.0.0.1:<ephemeral>, SERVING; `.servicer` exposes its admission queue."""
    server = await serve_ar(ar_engine, SerialExecutor("test-ar-service"))
    yield server
    await server.stop(None)


@pytest.fixture(scope="module")
async def ar(ar_stack):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{ar_stack.port}") as channel:
        yield ar_service_pb2_grpc.ArServiceStub(channel)


def batch_requests() -> list[pb.GenerateRequest]:
    return [pb.GenerateRequest(prompt=p, n=2, height=256, width=256, seed=s)
            for p, s in zip(BATCH_PROMPTS, BATCH_SEEDS, strict=True)]


@pytest.fixture(scope="module")
async def batch(ar) -> pb.GenerateBatchResponse:
    """3 prompts of different lengths x n=2 at 256x256: one GenerateBatch call, one model batch of 6 rows."""
    return await ar.GenerateBatch(pb.GenerateBatchRequest(requests=batch_requests()))


def tokenized_length(processor, prompt: str, height: int, width: int) -> int:
    """The processor's own encoding of the prompt, chat template and grid spec included, unpadded."""
    messages = [[{"role": "user", "content": [{"type": "text", "text": prompt}]}]]
    enc = processor.apply_chat_template(messages, tokenize=True, return_dict=True, processor_kwargs={
        "padding": False, "target_h": height, "target_w": width, "return_tensors": "pt"})
    return int(enc["input_ids"].shape[-1])


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels or None) or 0.0


async def test_batch_of_three_prompts_times_two_matches_each_request_alone(ar, batch) -> None:
    assert [len(r.outputs) for r in batch.responses] == [2, 2, 2]
    for resp, seed in zip(batch.responses, BATCH_SEEDS, strict=True):
        assert (resp.height, resp.width, resp.grid_height, resp.grid_width) == (256, 256, 16, 16)
        assert [o.seed for o in resp.outputs] == [seed, seed + 1]
        assert all(len(o.tokens.token_ids) == 16 * 16 for o in resp.outputs)
    # Padding and batch-mates change nothing: exact identity with each request run alone (see the report).
    for req, resp in zip(batch_requests(), batch.responses, strict=True):
        alone = await ar.Generate(req)
        assert alone == resp
    rows = [tuple(o.tokens.token_ids) for r in batch.responses for o in r.outputs]
    assert len(set(rows)) == 6


async def test_batched_row_equals_the_diffusers_pipeline_at_batch_1(ar_engine, batch) -> None:
    """The reference: GlmImagePipeline.generate_prior_tokens for one prompt, seeded with the output's seed."""
    from diffusers import GlmImagePipeline

    pipe = GlmImagePipeline(tokenizer=None, processor=ar_engine.processor, text_encoder=None,
                            vision_language_encoder=ar_engine.model, vae=None, transformer=None, scheduler=None)
    out = batch.responses[1].outputs[1]
    ids, _, _ = pipe.generate_prior_tokens(BATCH_PROMPTS[1], 256, 256, device=torch.device("cpu"),
                                           generator=torch.Generator().manual_seed(out.seed))
    assert ids[0].tolist() == list(out.tokens.token_ids)


async def test_usage_counts_real_prompt_and_generated_tokens(ar_engine, batch) -> None:
    lengths = [tokenized_length(ar_engine.processor, p, 256, 256) for p in BATCH_PROMPTS]
    assert len(set(lengths)) == 3  # really different lengths, so padding was in play
    for resp, length in zip(batch.responses, lengths, strict=True):
        for out in resp.outputs:
            assert out.usage.prompt_tokens == length  # padding excluded, template included
            # The tiny model's head has no end token, so every row runs the full plan; rows ending early are
            # counted up to their end token (test_completion_length_stops_at_the_end_token).
            assert out.usage.completion_tokens == COMPLETION_256
            assert out.usage.total_tokens == length + COMPLETION_256
            assert out.usage.reasoning_tokens == 0 and out.usage.cached_tokens == 0  # no prefix cache here
        assert resp.usage.prompt_tokens == 2 * length
        assert resp.usage.completion_tokens == 2 * COMPLETION_256
        assert resp.usage.total_tokens == 2 * (length + COMPLETION_256)


def test_completion_length_stops_at_the_end_token() -> None:
    from services.ar.domain import completion_length

    eos, pad = 129, 386
    assert completion_length([5, 6, 7], {eos}) == 3
    assert completion_length([5, eos, pad, pad], {eos}) == 2  # after the end token only padding follows
    assert completion_length([eos, pad], {eos}) == 1


async def test_generate_returns_n_rows_with_usage(ar, ar_engine) -> None:
    resp = await ar.Generate(pb.GenerateRequest(prompt=PROMPT, n=2, height=64, width=64, seed=7))
    assert [o.seed for o in resp.outputs] == [7, 8]
    assert (resp.grid_height, resp.grid_width) == (4, 4)
    length = tokenized_length(ar_engine.processor, PROMPT, 64, 64)
    for out in resp.outputs:
        assert len(out.tokens.token_ids) == 4 * 4
        assert all(0 <= t < 128 for t in out.tokens.token_ids)
        assert out.usage.prompt_tokens == length
        assert out.usage.completion_tokens == 16 * 16 + 2 * 2 + 1
    assert resp.usage.total_tokens == 2 * (length + 16 * 16 + 2 * 2 + 1)


async def test_output_i_uses_seed_plus_i(ar) -> None:
    a = await ar.Generate(pb.GenerateRequest(prompt=PROMPT, n=2, height=64, width=64, seed=100))
    b = await ar.Generate(pb.GenerateRequest(prompt=PROMPT, n=1, height=64, width=64, seed=101))
    assert a.outputs[1].tokens.token_ids == b.outputs[0].tokens.token_ids
    assert a.outputs[0].tokens.token_ids != a.outputs[1].tokens.token_ids


async def test_unseeded_request_reports_its_random_seed(ar) -> None:
    resp = await ar.Generate(pb.GenerateRequest(prompt=PROMPT, n=2, height=64, width=64))
    seed = resp.outputs[0].seed
    assert resp.outputs[1].seed == (seed + 1) % 2**32
    replay = await ar.Generate(pb.GenerateRequest(prompt=PROMPT, height=64, width=64, seed=resp.outputs[1].seed))
    assert replay.outputs[0].tokens == resp.outputs[1].tokens


async def test_sampling_parameters_change_the_tokens_and_stay_deterministic(ar) -> None:
    def req(**sampling):
        return pb.GenerateRequest(prompt=PROMPT, height=64, width=64, seed=3,
                                  sampling=common_pb2.SamplingParams(**sampling))

    # Mixed sampling parameters in one batch: each row is sampled with its own.
    both = await ar.GenerateBatch(pb.GenerateBatchRequest(requests=[req(), req(top_k=1)]))
    default, greedy = (r.outputs[0].tokens.token_ids for r in both.responses)
    assert default != greedy
    # top_k=1 leaves one candidate per step, so neither the seed nor the batch-mates matter.
    alone = await ar.Generate(pb.GenerateRequest(prompt=PROMPT, height=64, width=64, seed=4,
                                                 sampling=common_pb2.SamplingParams(top_k=1)))
    assert alone.outputs[0].tokens.token_ids == greedy


async def test_a_vanishing_temperature_samples_the_most_likely_token(ar) -> None:
    # float32's smallest denormal: logits / temperature overflow to inf, and softmax gives NaN. The limit of
    # sampling as the temperature goes to 0 is greedy decoding, whatever the seed: what top_k=1 gives.
    def req(seed: int, **sampling) -> pb.GenerateRequest:
        return pb.GenerateRequest(prompt=PROMPT, height=64, width=64, seed=seed,
                                  sampling=common_pb2.SamplingParams(**sampling))

    greedy = await ar.Generate(req(4, top_k=1))
    tiny = await ar.GenerateBatch(pb.GenerateBatchRequest(requests=[req(3, temperature=1e-45), req(5)]))
    assert tiny.responses[0].outputs[0].tokens == greedy.outputs[0].tokens
    assert tiny.responses[1].outputs[0].tokens != greedy.outputs[0].tokens  # its batch-mate still samples


async def test_sizes_round_up_to_multiples_of_32(ar) -> None:
    resp = await ar.Generate(pb.GenerateRequest(prompt=PROMPT, height=50, width=90, seed=1))
    assert (resp.height, resp.width) == (64, 96)
    assert (resp.grid_height, resp.grid_width) == (4, 6)
    assert len(resp.outputs[0].tokens.token_ids) == 4 * 6


@pytest.mark.parametrize("request_, field", [
    (pb.GenerateRequest(prompt="", height=64, width=64), "prompt"),
    (pb.GenerateRequest(prompt="   ", height=64, width=64), "prompt"),
    (pb.GenerateRequest(prompt="x" * 9000, height=64, width=64), "prompt"),
    (pb.GenerateRequest(prompt="x", n=17, height=64, width=64), "n"),
    (pb.GenerateRequest(prompt="x", height=0, width=64), "height"),
    (pb.GenerateRequest(prompt="x", height=64, width=0), "width"),
    (pb.GenerateRequest(prompt="x", height=4096, width=4096), "height"),
    (pb.GenerateRequest(prompt="x", height=1, width=2**32 - 1), "width"),  # the larger side is at fault
    (pb.GenerateRequest(prompt="x", height=64, width=64,
                        sampling=common_pb2.SamplingParams(temperature=0)), "sampling.temperature"),
    (pb.GenerateRequest(prompt="x", height=64, width=64,
                        sampling=common_pb2.SamplingParams(temperature=2.5)), "sampling.temperature"),
    (pb.GenerateRequest(prompt="x", height=64, width=64,
                        sampling=common_pb2.SamplingParams(temperature=float("nan"))), "sampling.temperature"),
    (pb.GenerateRequest(prompt="x", height=64, width=64,
                        sampling=common_pb2.SamplingParams(top_p=1.5)), "sampling.top_p"),
    (pb.GenerateRequest(prompt="x", height=64, width=64,
                        sampling=common_pb2.SamplingParams(top_p=0)), "sampling.top_p"),
    (pb.GenerateRequest(prompt="x", height=64, width=64,
                        sampling=common_pb2.SamplingParams(top_k=2_000_000)), "sampling.top_k"),
    # An id goes into the AR's log lines: bounded, and no control characters to forge lines with.
    (pb.GenerateRequest(prompt="x", height=64, width=64, request_id="r" * 1_000_000), "request_id"),
    (pb.GenerateRequest(prompt="x", height=64, width=64, request_id="r1\nforged log line"), "request_id"),
])
async def test_invalid_requests_name_the_field(ar, request_, field) -> None:
    before = sample("glmimage_ar_failures_total", reason="invalid_argument")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await ar.Generate(request_)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(f"{field}:")
    assert sample("glmimage_ar_failures_total", reason="invalid_argument") == before + 1


async def test_batch_with_mixed_sizes_is_rejected(ar) -> None:
    reqs = [pb.GenerateRequest(prompt="a", height=64, width=64), pb.GenerateRequest(prompt="b", height=128, width=64)]
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await ar.GenerateBatch(pb.GenerateBatchRequest(requests=reqs))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("requests:")


async def test_empty_batch_is_rejected(ar) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await ar.GenerateBatch(pb.GenerateBatchRequest())
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("requests:")


async def test_batch_errors_name_the_request_index(ar) -> None:
    reqs = [pb.GenerateRequest(prompt="a", height=64, width=64),
            pb.GenerateRequest(prompt="b", height=64, width=64, sampling=common_pb2.SamplingParams(top_p=2))]
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await ar.GenerateBatch(pb.GenerateBatchRequest(requests=reqs))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("requests[1].sampling.top_p:")
    reqs[1] = pb.GenerateRequest(prompt="b", height=64, width=64, request_id="r" * 257)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await ar.GenerateBatch(pb.GenerateBatchRequest(requests=reqs))
    assert err.value.details() == "requests[1].request_id: is 257 characters; the limit is 256"


@pytest.fixture(scope="module")
async def capped_ar(ar_engine):
    """A second server on the same model with --max-batch-outputs 3 (it only ever rejects: no model time)."""
    from runtime.limits import Limits
    from services.ar.engine import ArEngine

    engine = ArEngine(ar_engine.processor, ar_engine.model, ar_engine.device, Limits(max_batch_outputs=3))
    server = await serve_ar(engine, SerialExecutor("test-ar-capped"))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        yield ar_service_pb2_grpc.ArServiceStub(channel)
    await server.stop(None)


async def test_over_the_batch_cap_is_rejected_naming_the_cap(capped_ar) -> None:
    reqs = [pb.GenerateRequest(prompt="a", n=2, height=64, width=64)] * 2
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await capped_ar.GenerateBatch(pb.GenerateBatchRequest(requests=reqs))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("requests:")
    assert "4 outputs" in err.value.details() and "--max-batch-outputs 3" in err.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await capped_ar.Generate(pb.GenerateRequest(prompt="a", n=4, height=64, width=64))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("n:") and "at most 3 images in one batch" in err.value.details()
    assert "--" not in err.value.details()  # the gateway relays it to clients: no server flag in it


async def test_metrics_count_requests_batches_and_tokens(ar, ar_engine) -> None:
    before = {name: sample(name) for name in (
        "glmimage_ar_batch_size_count", "glmimage_ar_batch_size_sum", "glmimage_ar_generated_tokens_total",
        "glmimage_ar_prompt_tokens_total", "glmimage_ar_compute_seconds_count", "glmimage_ar_queue_seconds_count")}
    ok = sample("glmimage_ar_requests_total", outcome="ok")
    reqs = [pb.GenerateRequest(prompt=p, n=n, height=64, width=64, seed=1) for p, n in (("a", 1), ("b c", 2))]
    resp = await ar.GenerateBatch(pb.GenerateBatchRequest(requests=reqs))
    usage = [r.usage for r in resp.responses]
    assert sample("glmimage_ar_requests_total", outcome="ok") == ok + 2
    assert sample("glmimage_ar_batch_size_count") == before["glmimage_ar_batch_size_count"] + 1  # one model batch
    assert sample("glmimage_ar_batch_size_sum") == before["glmimage_ar_batch_size_sum"] + 3  # of three rows
    assert sample("glmimage_ar_compute_seconds_count") == before["glmimage_ar_compute_seconds_count"] + 1
    assert sample("glmimage_ar_queue_seconds_count") == before["glmimage_ar_queue_seconds_count"] + 1
    assert sample("glmimage_ar_generated_tokens_total") == (before["glmimage_ar_generated_tokens_total"]
                                                            + sum(u.completion_tokens for u in usage))
    assert sample("glmimage_ar_prompt_tokens_total") == (before["glmimage_ar_prompt_tokens_total"]
                                                         + sum(u.prompt_tokens for u in usage))


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (apt prometheus) is not installed")
def test_metrics_pass_promtool_lint() -> None:
    import services.ar.metrics  # noqa: F401 - registers the metrics

    names = {s.name for m in REGISTRY.collect() if m.name.startswith("glmimage_ar_") for s in m.samples}
    text = generate_latest(REGISTRY.restricted_registry(names))
    assert b"glmimage_ar_requests_total" in text and b"glmimage_ar_queue_seconds_bucket" in text
    lint = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, timeout=30)
    assert lint.returncode == 0, lint.stdout.decode() + lint.stderr.decode()


def test_warm_up_runs_the_prefill_and_a_few_decoding_steps_not_a_whole_image(ar_engine) -> None:
    """The warm-up runs every path a request does (prefill, then decoding with a KV cache behind it) but only
    WARM_UP_TOKENS of a 64x64 image's ~260 tokens: an AR's start should not cost a whole image."""
    from services.ar.domain import ArRequest
    from services.ar.engine import WARM_UP_TOKENS

    calls = []
    handle = ar_engine.model.register_forward_hook(lambda _m, args, kwargs, _out: calls.append(
        kwargs["input_ids"].shape[1] if kwargs.get("input_ids") is not None else 1), with_kwargs=True)
    try:
        ar_engine.warm_up()
        warm = list(calls)
        calls.clear()
        (result,) = ar_engine.generate([ArRequest(prompt="warm-up", n=1, height=64, width=64, seed=0)])
    finally:
        handle.remove()
    assert len(warm) == WARM_UP_TOKENS and warm[0] > 1 and set(warm[1:]) == {1}  # the prefill, then one at a time
    assert len(calls) > 200 and len(result.outputs) == 1  # a request decodes the whole preview and target grid
