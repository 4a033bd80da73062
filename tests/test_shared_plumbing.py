"""The pieces every process shares, from the protocol package (glmimage.wire, in the base install): the one size
parser (glmimage.wire.sizes), the one image-format map (glmimage.wire.formats) and the one client channel builder
(glmimage.wire.channels)."""
from __future__ import annotations

import argparse
import io
from collections.abc import Callable, Iterator
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from PIL import Image

import gateway.__main__ as gateway_main
import rest.__main__ as rest_main
from glmimage import cli
from glmimage.client import build_request
from glmimage.v1 import common_pb2
from glmimage.wire import formats
from glmimage.wire.channels import TlsConfig, aio_channel, channel_options, sync_channel
from glmimage.wire.keepalive import CLIENT_OPTIONS
from glmimage.wire.sizes import parse_size, size_arg
from rest import translate
from rest.errors import APIError
from rest.settings import RestSettings
from services.denoiser.encoding import ImageFormat, encode

# ---- sizes --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "size"), [("1024x768", (1024, 768)), (" 64X32 ", (64, 32)), ("1x1", (1, 1))])
def test_size_parses(text: str, size: tuple[int, int]) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize(("text", "why"), [
    ("abc", "size must be WIDTHxHEIGHT, e.g. 1024x1024"), ("512", "size must be WIDTHxHEIGHT"),
    ("512x", "size must be WIDTHxHEIGHT"), ("-5x5", "size must be WIDTHxHEIGHT"),
    ("5x5x5", "size must be WIDTHxHEIGHT"), ("1.5x2", "size must be WIDTHxHEIGHT"),
    ("\u00b2x2", "size must be WIDTHxHEIGHT"),  # str.isdigit() says yes, int() says no
    ("12345678x1", "size must be WIDTHxHEIGHT"), ("0x256", "positive"), ("256x0", "positive"),
])
def test_bad_size_says_what_a_size_is(text: str, why: str) -> None:
    with pytest.raises(ValueError, match=why) as err:
        parse_size(text)
    assert repr(text) in str(err.value)
    with pytest.raises(argparse.ArgumentTypeError, match=why):
        size_arg(text)


def test_a_long_bad_size_is_shown_cut_short() -> None:
    with pytest.raises(ValueError) as err:
        parse_size("9" * 100_000)
    assert len(str(err.value)) < 120  # the REST front sends it back to the caller


def _usage_error(parse: Callable[[], object], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exit_:
        parse()
    assert exit_.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("text", ["big", "0x64"])
def test_every_entry_point_refuses_a_bad_size_alike(text: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError) as parsed:
        parse_size(text)
    expected = str(parsed.value)
    errors = {
        "gateway": _usage_error(lambda: gateway_main.parse_args(["--default-size", text]), capsys),
        "rest": _usage_error(lambda: rest_main.parse_args(["--default-size", text]), capsys),
        "cli": _usage_error(lambda: cli.build_parser().parse_args(["generate", "p", "--size", text]), capsys),
    }
    assert all(expected in err for err in errors.values()), errors
    with pytest.raises(ValueError, match="size must"):
        build_request("p", size=text)
    with pytest.raises(APIError) as api:
        translate.parse_size(text, RestSettings())
    assert expected in api.value.message and api.value.param == "size"


def test_entry_points_read_a_good_size_alike() -> None:
    assert gateway_main.parse_args(["--default-size", "320X192"]).default_size == (320, 192)
    assert rest_main.parse_args(["--default-size", "320X192"]).default_size == (320, 192)
    assert cli.build_parser().parse_args(["generate", "p", "--size", "320X192"]).size == (320, 192)
    assert translate.parse_size("320X192", RestSettings()) == (320, 192)


# ---- formats ------------------------------------------------------------------------------------------------------


def test_every_declared_image_format_has_an_entry() -> None:
    """A value added to glmimage.v1.ImageFormat must be added to the map (and so to every process) too."""
    declared = set(common_pb2.ImageFormat.values()) - {common_pb2.IMAGE_FORMAT_UNSPECIFIED}
    assert set(formats.BY_PROTO) == declared
    assert {f.value for f in ImageFormat} == set(formats.BY_NAME) == set(formats.FORMATS)


@pytest.mark.parametrize("fmt", list(ImageFormat))
def test_the_encoder_writes_what_the_map_says(fmt: ImageFormat) -> None:
    spec = formats.by_name(fmt.value.upper())
    image = Image.open(io.BytesIO(encode(Image.new("RGB", (8, 8), (200, 10, 10)), fmt)))
    assert (image.format, Image.MIME[image.format]) == (spec.pil, spec.mime)
    assert formats.name_of(spec.proto) == spec.name == translate.FORMAT_NAMES[spec.proto]
    assert build_request("p", output_format=spec.name).output_format == spec.proto


def test_unspecified_and_unknown_formats_fall_back() -> None:
    assert formats.name_of(common_pb2.IMAGE_FORMAT_UNSPECIFIED) == formats.DEFAULT.name
    assert formats.name_of(99, default="jpeg") == "jpeg"
    with pytest.raises(ValueError, match="output_format must be one of"):
        formats.by_name("gif")


# ---- channels -----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def health_server() -> Iterator[str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(None)


def test_options_keepalive_then_name_override_then_the_hops_own() -> None:
    opts = channel_options(TlsConfig(server_name="gw.internal"), [("grpc.keepalive_time_ms", 20_000)])
    assert opts[:len(CLIENT_OPTIONS)] == list(CLIENT_OPTIONS)
    # grpc lets a later argument win, as a dict does: the hop's own options override the shared ones.
    assert dict(opts)["grpc.keepalive_time_ms"] == 20_000
    assert dict(opts)["grpc.ssl_target_name_override"] == "gw.internal"
    assert "grpc.ssl_target_name_override" not in dict(channel_options(TlsConfig()))


def test_half_a_client_certificate_is_refused() -> None:
    with pytest.raises(ValueError, match="both client_cert and client_key"):
        TlsConfig(root_ca=b"ca", client_cert=b"cert")


def test_sync_channel_plaintext_and_tls(health_server: str) -> None:
    request = health_pb2.HealthCheckRequest()
    with sync_channel(health_server) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(request, timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    # A TLS channel really speaks TLS: the plaintext server cannot answer its handshake.
    with sync_channel(health_server, TlsConfig()) as channel, pytest.raises(grpc.RpcError) as err:
        health_pb2_grpc.HealthStub(channel).Check(request, timeout=10)
    assert err.value.code() is grpc.StatusCode.UNAVAILABLE


async def test_aio_channel_plaintext_and_tls(health_server: str) -> None:
    request = health_pb2.HealthCheckRequest()
    async with aio_channel(health_server) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(request, timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    async with aio_channel(health_server, TlsConfig()) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await health_pb2_grpc.HealthStub(channel).Check(request, timeout=10)
    assert err.value.code() is grpc.StatusCode.UNAVAILABLE
