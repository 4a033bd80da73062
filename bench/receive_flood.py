"""Memory a flood of large messages makes each server hold: the AR and a denoiser requiring the internal token, a
gateway with an API key and one without any key, as real processes on the tiny model.

Each scenario sends CALLERS concurrent calls (each on its own connection) of a large message, ROUNDS times, and
samples the server's RSS: ``peak`` is the highest seen above its idle figure, ``kept`` what it still holds a second
after. ``unauthenticated``: the reported repro (a field claiming 60 MiB, and 60 MiB of bytes) with no credential;
``admitted``: the same from a caller the server admits (the right token or key, or none needed), the message just
within the server's receive limit, or 60 MiB where the revision has no such limit.

    python -m bench.receive_flood            # bench/results/receive_flood.json

To compare with an earlier revision, copy this file into its checkout and run it there with
``--name receive_flood_before``: the report puts both side by side.
"""
from __future__ import annotations

import argparse
import secrets
import tempfile
import threading
import time
from pathlib import Path

import grpc
import psutil

from bench.common import write_result
from tests.support.cluster import Cluster

GENERATE = "/glmimage.v1.GatewayService/GenerateImages"
AR_BATCH = "/glmimage.v1.ArService/GenerateBatch"
DENOISE = "/glmimage.v1.DenoiserService/Denoise"
# The reported repro: a field that claims 60 MiB of bytes, and 60 MiB of them.
FLOOD = b"\x0a\x80\x80\x80\x1e" + b"a" * (60 << 20)
CALLERS, ROUNDS = 12, 2


def bearer(secret: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {secret}"),)


def _call(address: str, method: str, payload: bytes, metadata: tuple) -> grpc.StatusCode:
    with grpc.insecure_channel(address, options=[("grpc.max_send_message_length", -1)]) as channel:
        try:
            channel.unary_unary(method)(payload, metadata=metadata, timeout=120)
        except grpc.RpcError as err:
            return err.code()
    return grpc.StatusCode.OK


def flood(pid: int, address: str, method: str, payload: bytes = FLOOD, metadata: tuple = ()
          ) -> tuple[int, set[grpc.StatusCode]]:
    """Peak RSS above idle of process ``pid`` while CALLERS threads, each on its own connection, send ``payload``
    to ``method`` ROUNDS times; and the codes they got."""
    proc = psutil.Process(pid)
    idle = proc.memory_info().rss
    peak, done = idle, threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, proc.memory_info().rss)
            done.wait(0.005)

    sampler = threading.Thread(target=sample)
    sampler.start()
    codes: set[grpc.StatusCode] = set()

    def caller() -> None:
        codes.add(_call(address, method, payload, metadata))

    try:
        for _ in range(ROUNDS):
            callers = [threading.Thread(target=caller) for _ in range(CALLERS)]
            for t in callers:
                t.start()
            for t in callers:
                t.join()
    finally:
        done.set()
        sampler.join()
    return peak - idle, codes


def _limit(name: str) -> int:
    try:
        from runtime.limits import Limits, max_request_bytes
    except ImportError:  # a revision before the receive limits: its servers took up to 64 MiB
        return len(FLOOD)
    limits = Limits()
    return {"ar": max_request_bytes(limits, prompts=limits.max_batch_outputs),
            "denoiser": max_request_bytes(limits, tokens=True)}.get(name, max_request_bytes(limits))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--name", default="receive_flood", help="results file: bench/results/NAME.json")
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="receive-flood-"))
    token, key = secrets.token_urlsafe(24), secrets.token_urlsafe(24)
    (work / "token").write_text(token)
    procs = Cluster(work / "procs")
    results: dict[str, dict[str, dict[str, object]]] = {}
    try:
        procs.start("ar", "ar", ["--internal-token-file", str(work / "token")], env={"GLMIMAGE_INTERNAL_TOKEN": ""})
        procs.start("denoiser", "denoiser", ["--internal-token-file", str(work / "token")],
                    env={"GLMIMAGE_INTERNAL_TOKEN": ""})
        unreachable = ["--ar", "127.0.0.1:1", "--denoiser", "127.0.0.1:2"]
        procs.start("keyed", "gateway", [*unreachable, f"--api-key={key}"])
        procs.start("open", "gateway", unreachable)
        methods = {"ar": AR_BATCH, "denoiser": DENOISE, "keyed": GENERATE, "open": GENERATE}
        credentials = {"ar": bearer(token), "denoiser": bearer(token), "keyed": bearer(key), "open": ()}
        for name, method in methods.items():
            proc = procs.procs[name]
            for scenario, payload, metadata in (
                    ("unauthenticated", FLOOD, ()),
                    ("admitted", FLOOD[:5] + b"a" * (min(_limit(name), len(FLOOD)) - 5), credentials[name])):
                if scenario == "unauthenticated" and name == "open":
                    continue  # nothing to authenticate
                idle = proc.rss()
                peak, codes = flood(proc.pid, proc.address, method, payload, metadata)
                time.sleep(1.0)
                row = {"idle_mb": idle >> 20, "peak_mb": peak >> 20, "kept_mb": max(0, proc.rss() - idle) >> 20,
                       "message_mb": round(len(payload) / (1 << 20), 1), "codes": sorted(c.name for c in codes)}
                results.setdefault(name, {})[scenario] = row
                print(f"{name:9s} {scenario:16s} {row}", flush=True)
    finally:
        procs.close()
    write_result(args.name, {"callers": CALLERS, "rounds": ROUNDS, "servers": results},
                 f"python -m bench.receive_flood --name {args.name}")


if __name__ == "__main__":
    main()
