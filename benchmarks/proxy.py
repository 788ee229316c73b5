"""Latency added by ``ledger proxy`` over calling ``ledger engine serve`` directly.

Three paths to the same upstream, measured in the same run, requests interleaved in a
shuffled order so that drift (other load, thermal) hits all of them alike:

- ``direct``: the client calls ``ledger engine serve``;
- ``proxy (forward only)``: through ``ledger proxy --no-record`` (the reverse proxy alone);
- ``proxy (recording)``: through ``ledger proxy`` recording to a real ``ledger serve`` on a
  scratch PostgreSQL database (signing, spooling and shipping run while it is measured).

One client, one request at a time, keep-alive connections (httpx), ``max_tokens`` small so
generation is short; the generation time is in every path, so the difference of the
percentiles is what the proxy adds. Latency is until the last byte of the body (streams
included). A last case, ``GET /v1/models``, involves no generation at all: it shows
the reverse proxy's own cost. Then the CPU cost of capture itself is timed in-process.

    python benchmarks/proxy.py [--requests 1000] [--max-tokens 4]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks._common import machine, pct, scratch_database, table  # noqa: E402
from tests.helpers import run_ledger  # noqa: E402


@contextmanager
def serve(args: list[str], port: int, health: str, log: Path,
          env: dict[str, str] | None = None) -> Iterator[str]:
    with run_ledger(args, port=port, health_path=health, log_path=log, env=env,
                    timeout=90) as (base, _):
        yield base


def cases(max_tokens: int) -> dict[str, tuple[str, str, dict[str, Any] | None]]:
    chat = [{"role": "user", "content": "What is a transparency log?"}]
    return {
        "completion": ("POST", "/v1/completions", {
            "model": "tiny-demo", "prompt": "Hello there", "max_tokens": max_tokens,
            "temperature": 0}),
        "chat": ("POST", "/v1/chat/completions", {
            "model": "tiny-demo", "messages": chat, "max_tokens": max_tokens,
            "temperature": 0.7, "seed": 1}),
        "chat stream": ("POST", "/v1/chat/completions", {
            "model": "tiny-demo", "messages": chat, "max_tokens": max_tokens,
            "temperature": 0, "stream": True}),
        "no generation (GET /v1/models)": ("GET", "/v1/models", None),
    }


def timed(client: httpx.Client, method: str, path: str, body: dict[str, Any] | None) -> float:
    started = time.perf_counter()
    with client.stream(method, path, json=body) as r:
        for _ in r.iter_raw():
            pass
        if r.status_code != 200:
            raise SystemExit(f"{path}: HTTP {r.status_code}")
    return time.perf_counter() - started


def capture_cost(engine: str, work: Path, max_tokens: int,
                 n: int = 2000) -> list[list[object]]:
    """In-process CPU cost of capture, per request: on the request path (rewrite the
    request, edit the answer, queue the capture) and in the background (build, validate,
    sign and serialise the envelope; the spool commit is batched and not counted)."""
    from ledger.capture import CaptureConfig, Recorder
    from ledger.capture.config import load_key
    from ledger.capture.exchange import StreamEditor, edit_response, prepare
    from ledger.core.canonical import canonical_json
    from ledger.core.envelope import validate_statement
    from ledger.producer import build_statement, envelope_to_json, sign_statement

    config = CaptureConfig.from_files(artifacts=work / "art.json",
                                      fingerprint=work / "fp.json")
    key = load_key(work / "key.pem")
    rows: list[list[object]] = []
    with Recorder(config, key, spool_dir=work / "spool-cost", ledger_url=None,
                  ship=False) as recorder:
        for case, (method, path, body) in cases(max_tokens).items():
            if method != "POST" or body is None:
                continue
            kind = "chat" if path.endswith("/chat/completions") else "completion"
            raw = json.dumps(body).encode()
            sent, plan = prepare(kind, raw)
            upstream = httpx.post(engine + path, content=sent, timeout=60,
                                  headers={"content-type": "application/json"}).content
            front, back = [], []
            for _ in range(n):
                t0 = time.perf_counter()
                _, plan = prepare(kind, raw)
                if plan.stream:
                    editor = StreamEditor(plan)
                    editor.feed(upstream)
                    editor.finish()
                    captured = editor.captured()
                else:
                    _, captured = edit_response(plan, upstream)
                for c in captured:
                    recorder.record(c)
                t1 = time.perf_counter()
                c = captured[0]
                statement = build_statement(
                    request_id=c.request_id, artifacts=config.artifacts,
                    prompt_token_ids=c.prompt_token_ids, sampling=c.sampling,
                    runtime=config.runtime, output=c.output())
                validate_statement(statement)
                canonical_json(envelope_to_json(sign_statement(statement, key)))
                t2 = time.perf_counter()
                front.append(t1 - t0)
                back.append(t2 - t1)
            rows.append([case, len(upstream), round(pct(front, 50) * 1e6),
                         round(pct(front, 99) * 1e6), round(pct(back, 50) * 1e6),
                         round(pct(back, 99) * 1e6)])
        recorder.flush(60)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=1000, help="per path and case")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=50)
    args = ap.parse_args()

    from ledger.core.keys import private_pem
    from tests.conftest import provision
    from tests.helpers import free_port

    work = Path(tempfile.mkdtemp(prefix="ledger-bench-proxy-"))
    with ExitStack() as stack:
        db_url = stack.enter_context(scratch_database("ledger_bench_proxy"))
        keys, producer = provision(db_url)
        (work / "key.pem").write_bytes(private_pem(producer))
        ledger_port, engine_port, rec_port, fwd_port = (free_port() for _ in range(4))
        ledger = stack.enter_context(serve(["serve", "--port", str(ledger_port)], ledger_port,
                                           "/healthz", work / "ledger.log",
                                           {"LEDGER_DATABASE_URL": db_url}))
        engine = stack.enter_context(serve(
            ["engine", "serve", "--port", str(engine_port), "--batch-wait-ms", "0",
             "--threads", "1",
             "--write-fingerprint", str(work / "fp.json")],
            engine_port, "/health", work / "engine.log"))
        subprocess.run([sys.executable, "-m", "ledger.cli.main", "artifact", "hash",
                        "tiny-demo"], stdout=(work / "art.json").open("wb"), check=True,
                       cwd=REPO)
        recording = stack.enter_context(serve(
            ["proxy", "--upstream", engine, "--port", str(rec_port), "--key",
             str(work / "key.pem"), "--fingerprint", str(work / "fp.json"), "--artifacts",
             str(work / "art.json"), "--spool", str(work / "spool")],
            rec_port, "/ledger/capture/status", work / "proxy.log",
            {"LEDGER_API_URL": ledger, "LEDGER_API_KEY": keys["ingester"]}))
        forward = stack.enter_context(serve(
            ["proxy", "--upstream", engine, "--port", str(fwd_port), "--no-record"],
            fwd_port, "/ledger/capture/status", work / "proxy-forward.log"))

        paths = {"direct": engine, "proxy (forward only)": forward,
                 "proxy (recording)": recording}
        clients = {name: stack.enter_context(httpx.Client(base_url=url, timeout=60))
                   for name, url in paths.items()}
        work_items = [(case, name) for case in cases(args.max_tokens) for name in paths]
        for case, name in work_items:                          # warm every path
            for _ in range(args.warmup):
                timed(clients[name], *cases(args.max_tokens)[case])
        samples: dict[tuple[str, str], list[float]] = {item: [] for item in work_items}
        order = work_items * args.requests
        random.Random(7).shuffle(order)
        started = time.perf_counter()
        for case, name in order:
            samples[(case, name)].append(timed(clients[name], *cases(args.max_tokens)[case]))
        elapsed = time.perf_counter() - started

        status = httpx.get(recording + "/ledger/capture/status").json()
        deadline = time.monotonic() + 60
        while status["spool"]["pending"] and time.monotonic() < deadline:
            time.sleep(0.2)
            status = httpx.get(recording + "/ledger/capture/status").json()
        cost_rows = capture_cost(engine, work, args.max_tokens)

    rows = []
    for case in cases(args.max_tokens):
        base = samples[(case, "direct")]
        b50, b99 = pct(base, 50) * 1e3, pct(base, 99) * 1e3
        for name in paths:
            s = samples[(case, name)]
            p50, p99 = pct(s, 50) * 1e3, pct(s, 99) * 1e3
            rows.append([case, name, len(s), round(p50, 2), round(p99, 2),
                         "" if name == "direct" else f"{p50 - b50:+.2f}",
                         "" if name == "direct" else f"{p99 - b99:+.2f}",
                         round(statistics.mean(s) * 1e3, 2)])
    print(f"machine: {machine()}")
    print(f"{args.requests} requests per path and case, max_tokens={args.max_tokens}, one "
          f"client, sequential, keep-alive; {elapsed:.1f} s measured")
    print(table(["case", "path", "n", "p50 ms", "p99 ms", "added p50 ms", "added p99 ms",
                 "mean ms"], rows))
    print(f"recording proxy: {status['recorded']} recorded, {status['spool']['totals']} "
          f"(spool pending {status['spool']['pending']}, quarantined "
          f"{status['spool']['quarantined']}, unrecordable {status['unrecordable']})")
    print("\ncapture CPU cost per request, in-process (microseconds):")
    print(table(["case", "upstream bytes", "request path p50", "request path p99",
                 "background p50", "background p99"], cost_rows))


if __name__ == "__main__":
    main()
