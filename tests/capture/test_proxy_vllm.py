"""Issue 12, acceptance 2: ``ledger proxy`` in front of a real ``vllm serve`` on the GPU host,
with the ledger (``ledger serve`` on PostgreSQL) beside it.

1. The proxy's byte-identity cases (tests/capture/test_proxy.py's ``CASES``: completions,
   chat, streams, usage chunks, stop strings, client-requested logprobs) get vLLM's own
   bytes through the proxy, and each call is a valid envelope of this runtime.
2. At least 50 more requests (greedy and seeded top-k/top-p/min-p/penalties, completions
   and chat, streamed and not, prompts of 8-600 tokens, up to 16 in flight so vLLM batches
   them) are recorded; every envelope recorded here is disputed and replayed by the worker
   with ``--engine vllm`` (``vllm.LLM`` in this process, ``skip_tokenizer_init``) to
   ``reproduced``/``bitwise``; some of them ended at EOS, which the envelope records and the
   replay reproduces.
3. One record altered at token k and re-signed (a compromised gateway) ends ``diverged`` at k.

The model: a Llama-family safetensors checkpoint (tests/engine/test_vllm_gpu.py's
``SMALL_LLAMA``, N(0, 1/fan_in) weights) with a byte-level ``tokenizers`` tokenizer and a chat
template, written to ``LEDGER_VLLM_TEST_MODEL`` when that names a folder, else to a temporary
one. Marked ``gpu``; skipped without CUDA or vLLM. ``scripts/vllm_e2e.sh`` runs it on a host
without PostgreSQL (embedded PostgreSQL, ``LEDGER_TEST_PG``).

``LEDGER_E2E_UPSTREAM=engine`` runs the same module on CPU against ``ledger engine serve``
(tiny-demo) with the reference engine replaying: a dry run of the harness itself.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from ledger import artifacts
from ledger.core.envelope import validate_statement
from ledger.core.keys import private_pem
from tests.capture.conftest import (
    TINY_DEMO_DIR,
    CaptureFiles,
    Process,
    ledger_env,
    proxy_args,
    run_process,
    wait_for_envelope,
)
from tests.capture.test_proxy import CASES, _call, _created, _response_id
from tests.helpers import REPO, ApiServer, free_port, stop_process

UPSTREAM = os.environ.get("LEDGER_E2E_UPSTREAM", "vllm")
#: `vllm serve --max-num-seqs` (= the fingerprint's = the worker's engine's). Measured with
#: 16 (commit 6aa7ed1's labelling, which admitted it): 41 of 86 records bitwise, 25
#: token-identical, 20 diverged; hence vllm_adapter.MAX_SERVE_SEQS = 1.
SERVE_SEQS = 1
VLLM_MODEL = "small-llama"
#: Cases whose tiny-demo specifics do not carry over to a random-weight model.
VLLM_OVERRIDES: dict[str, dict[str, Any]] = {
    # no max_tokens: end on any non-byte token (3/4 of the vocabulary), not tiny-demo's "g"
    "chat-no-max-tokens": {"messages": [{"role": "user", "content": "Hi there"}],
                           "temperature": 0,
                           "extra_body": {"stop_token_ids": list(range(256, 1024))}},
}

if UPSTREAM == "vllm":
    pytestmark = [
        pytest.mark.gpu,
        pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                           reason="vllm is not installed"),
    ]


@dataclass
class Upstream:
    base_url: str
    model: str            # the served name clients ask for
    model_dir: Path       # what the worker holds and the artifacts hash
    engine: str           # the worker's engine: vllm | reference
    dtype: str
    fingerprint: dict[str, Any]
    eos: int | None


def _vllm_env() -> dict[str, str]:
    from workers.engine.vllm_adapter import VLLM_ENV

    env = {**os.environ, **VLLM_ENV}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING")   # the server keeps its engine process
    return env


@pytest.fixture(scope="module")
def upstream(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Upstream]:
    d = tmp_path_factory.mktemp("upstream")
    port = free_port()
    if UPSTREAM == "engine":
        with run_process(["engine", "serve", "--model", "tiny-demo", "--port", str(port),
                          "--max-batch", "16", "--write-fingerprint", str(d / "fp.json")],
                         health_path="/health", port=port, log_path=d / "engine.log") as p:
            fp = httpx.get(p.base_url + "/ledger/fingerprint").json()
            yield Upstream(p.base_url, "tiny-demo", TINY_DEMO_DIR, "reference", "float32",
                           fp, None)
        return
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from benchmarks.vllm import write_byte_tokenizer, write_checkpoint
    from tests.engine.test_vllm_gpu import EOS, SMALL_LLAMA
    from workers.engine.vllm_adapter import serve_args

    model = Path(os.environ.get("LEDGER_VLLM_TEST_MODEL") or d / VLLM_MODEL)
    if not (model / "config.json").is_file():
        write_checkpoint(model, SMALL_LLAMA, seed=3)
    write_byte_tokenizer(model, SMALL_LLAMA)
    # what an operator runs on the GPU node: `ledger fingerprint --engine vllm`
    fp = json.loads(subprocess.run(
        [sys.executable, "-m", "ledger.cli.main", "fingerprint", "--engine", "vllm",
         "--device", "cuda", "--dtype", "bfloat16", "--max-num-seqs", str(SERVE_SEQS)],
        check=True, capture_output=True,
        env=_vllm_env(), cwd=REPO, timeout=300).stdout)
    assert fp["runtime"]["batch_invariant"] is True, fp["runtime"]
    log_path = d / "vllm.log"
    log = log_path.open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model),
         "--served-model-name", VLLM_MODEL, "--host", "127.0.0.1", "--port", str(port),
         "--gpu-memory-utilization", "0.3", "--generation-config", "vllm",
         *serve_args(max_model_len=int(SMALL_LLAMA["max_position_embeddings"]),
                     max_num_seqs=SERVE_SEQS)],
        env=_vllm_env(), stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited: {log_path.read_text()[-4000:]}")
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, log_path.read_text()[-4000:]
            time.sleep(0.5)
        # the pin plugin loaded by `vllm serve` itself (through the entry point)
        assert "inference-ledger: top-k/top-p pinned" in log_path.read_text(errors="replace")
        yield Upstream(base, VLLM_MODEL, model, "vllm", "bfloat16", fp, EOS)
    finally:
        stop_process(proc)
        log.close()
        print("vllm serve log tail:\n" + log_path.read_text(errors="replace")[-3000:])


@pytest.fixture(scope="module")
def files(api: ApiServer, upstream: Upstream,
          tmp_path_factory: pytest.TempPathFactory) -> CaptureFiles:
    d = tmp_path_factory.mktemp("e2e-files")
    (d / "producer.pem").write_bytes(private_pem(api.producer))  # type: ignore[attr-defined]
    doc = artifacts.artifact_hashes(upstream.model_dir, model_name=upstream.model)
    (d / "artifacts.json").write_text(json.dumps(doc))
    (d / "fingerprint.json").write_text(json.dumps(upstream.fingerprint))
    return CaptureFiles(d / "producer.pem", d / "artifacts.json", d / "fingerprint.json", doc)


@pytest.fixture(scope="module")
def proxy(api: ApiServer, upstream: Upstream, files: CaptureFiles,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Process]:
    d = tmp_path_factory.mktemp("e2e-proxy")
    port = free_port()
    with run_process(proxy_args(files, upstream.base_url, port, d / "spool"),
                     health_path="/ledger/capture/status", port=port,
                     log_path=d / "proxy.log", env=ledger_env(api)) as p:
        yield p


@pytest.fixture(scope="module")
def clients(proxy: Process, upstream: Upstream) -> tuple[openai.OpenAI, openai.OpenAI]:
    return (openai.OpenAI(base_url=proxy.base_url + "/v1", api_key="unused", max_retries=0),
            openai.OpenAI(base_url=upstream.base_url + "/v1", api_key="unused",
                          max_retries=0))


#: request IDs recorded by this module (all are replayed by the last test)
RECORDED: list[str] = []


def _case_args(name: str, args: dict[str, Any]) -> dict[str, Any]:
    return VLLM_OVERRIDES.get(name, args) if UPSTREAM == "vllm" else args


@pytest.mark.parametrize("stream", [False, True], ids=["body", "stream"])
@pytest.mark.parametrize(("name", "endpoint", "args"), CASES, ids=[c[0] for c in CASES])
def test_proxy_gives_the_upstreams_bytes(
    clients: tuple[openai.OpenAI, openai.OpenAI], api: ApiServer, upstream: Upstream,
    files: CaptureFiles, name: str, endpoint: str, args: dict[str, Any], stream: bool,
) -> None:
    via, direct = clients
    args = _case_args(name, args)
    for _attempt in range(3):
        request_id = f"{name}-{uuid.uuid4().hex[:12]}"
        while time.time() % 1 > 0.6:          # keep both calls inside one second
            time.sleep(0.05)
        through_proxy = _call(via, endpoint, args, stream, request_id, model=upstream.model)
        statement = wait_for_envelope(api, _response_id(endpoint, request_id))
        direct_args = dict(args)
        if "seed" not in args:
            direct_args["seed"] = statement["predicate"]["sampling"]["seed"]
        direct_bytes = _call(direct, endpoint, direct_args, stream, request_id,
                             model=upstream.model)
        if _created(through_proxy) == _created(direct_bytes):
            break
    RECORDED.append(_response_id(endpoint, request_id))
    assert through_proxy == direct_bytes
    validate_statement(statement)
    p = statement["predicate"]
    assert p["artifacts"] == files.artifacts_doc
    assert p["runtime"] == upstream.fingerprint["runtime"]
    assert p["channel"] == "deterministic" and p["tier"] == "bitwise"


def _mixed_requests(n: int, seed: int = 7) -> list[tuple[str, dict[str, Any], bool]]:
    """(endpoint, arguments, stream) for ``n`` requests of every admitted sampling mode."""
    rng = random.Random(seed)
    modes: list[dict[str, Any]] = [
        {"temperature": 0},
        {"temperature": 1.0, "top_p": 0.9},
        {"temperature": 0.9, "extra_body": {"top_k": 8}},
        {"temperature": 1.1, "top_p": 0.95, "extra_body": {"top_k": 40}},
        {"temperature": 1.0, "presence_penalty": 0.2, "frequency_penalty": 0.1,
         "extra_body": {"min_p": 0.05, "repetition_penalty": 1.1}},
        {"temperature": 1.5},                     # long and hot: some end at EOS
    ]
    vocab = 1000 if UPSTREAM == "vllm" else 256
    out = []
    for i in range(n):
        mode = dict(modes[i % len(modes)])
        if i % 2:
            mode["seed"] = 5000 + i               # the others: the proxy pins one
        hot = mode.get("temperature") == 1.5
        max_tokens = 200 if hot else rng.randrange(8, 64)
        if i % 5 == 4:
            content = "".join(chr(rng.randrange(97, 123)) for _ in range(rng.randrange(4, 80)))
            out.append(("chat", {"messages": [{"role": "user", "content": content}],
                                 "max_tokens": max_tokens, **mode}, i % 3 == 0))
        else:
            prompt = [rng.randrange(vocab) for _ in range(rng.randrange(8, 600))]
            out.append(("completions", {"prompt": prompt, "max_tokens": max_tokens, **mode},
                        i % 3 == 0))
    return out


def test_fifty_requests_in_flight_are_recorded(
    clients: tuple[openai.OpenAI, openai.OpenAI], api: ApiServer, upstream: Upstream,
) -> None:
    via, _ = clients
    requests = _mixed_requests(60)

    def send(i: int) -> str:
        endpoint, args, stream = requests[i]
        request_id = f"mix-{i}-{uuid.uuid4().hex[:8]}"
        _call(via, endpoint, args, stream, request_id, model=upstream.model)
        return _response_id(endpoint, request_id)

    with ThreadPoolExecutor(16) as pool:             # up to 16 in flight: vLLM batches them
        ids = list(pool.map(send, range(len(requests))))
    statements = [wait_for_envelope(api, rid) for rid in ids]
    RECORDED.extend(ids)
    for st in statements:
        validate_statement(st)
        assert st["predicate"]["tier"] == "bitwise"
    if upstream.eos is not None:
        at_eos = [st["predicate"]["output"] for st in statements
                  if st["predicate"]["output"]["finish_reason"] == "stop"]
        assert at_eos, "no request ended at EOS: the EOS check would be vacuous"
        for out in at_eos:       # the envelope records EOS as the last token
            assert out["token_ids"][-1] == upstream.eos, out["token_ids"][-8:]
            assert upstream.eos not in out["token_ids"][:-1]


def test_every_recorded_request_replays_bitwise_and_an_altered_one_diverges_at_k(
    api: ApiServer, upstream: Upstream,
) -> None:
    from ledger.core.keys import generate_private_key
    from ledger.db.session import make_engine, session_scope
    from ledger.replay.records import Signer
    from ledger.settings import Settings
    from tests.replay.conftest import Recorded, tamper
    from workers.replay import ReplayWorker

    assert len(RECORDED) >= 50 + len(CASES), len(RECORDED)
    honest = wait_for_envelope(api, next(r for r in RECORDED if r.startswith("cmpl-mix-")))
    k = 3
    assert len(honest["predicate"]["output"]["token_ids"]) > k
    original = honest["predicate"]["output"]["token_ids"][k]
    altered = tamper(Recorded(honest["predicate"]["request_id"], honest, {}),
                     api.producer, k, f"altered-{uuid.uuid4().hex[:8]}")  # type: ignore[attr-defined]
    with api.client("ingester") as c:
        r = c.post("/v1/envelopes", params={"wait": True}, json=altered.envelope)
        assert r.status_code in (200, 201), r.text

    settings = Settings(database_url=api.db_url,  # type: ignore[attr-defined]
                        vllm_engine_args={"gpu_memory_utilization": 0.3})
    db = make_engine(settings, pool_size=2)
    signer = Signer(generate_private_key(), "worker", "vllm-e2e-worker")
    with session_scope(db) as s:
        signer.ensure_registered(s)
    # this test is about record -> replay; the trust-policy paths are tests/replay's
    worker = ReplayWorker(settings, db, models=[upstream.model_dir],
                          engine_name=upstream.engine, dtype=upstream.dtype,
                          device="cuda" if upstream.engine == "vllm" else "cpu",
                          max_batch=SERVE_SEQS if upstream.engine == "vllm" else 16,
                          signer=signer, insecure_dev=True)
    assert worker.fingerprint_id == upstream.fingerprint["fingerprint_id"], (
        worker.runtime, upstream.fingerprint["runtime"])
    worker.register()
    outcomes: dict[str, tuple[str, str]] = {}
    try:
        with api.client("reviewer") as c:
            for rid in [*RECORDED, altered.request_id]:
                r = c.post("/v1/disputes", json={"request_id": rid, "reason": "vllm e2e"})
                assert r.status_code == 201, r.text
                assert r.json()["state"] == "queued", r.json()
                assert worker.run_job(r.json()["job_id"]) == "done"
                d = c.get(f"/v1/disputes/{r.json()['id']}").json()
                outcomes[rid] = (d["verdict"]["outcome"], d["verdict"]["tier"])
                if outcomes[rid][0] != "reproduced":
                    print("NOT REPRODUCED", rid, outcomes[rid],
                          json.dumps(d["verdict"].get("details"))[:600])
                if rid == altered.request_id:
                    div = d["verdict"]["details"]["first_divergence"]
    finally:
        worker.stop()
        db.dispose()
    bad = outcomes.pop(altered.request_id)
    assert bad[0] == "diverged", bad
    assert (div["index"], div["expected_token"], div["replayed_token"]) == (
        k, (original + 1) % 256, original)
    summary = {o: sum(1 for v in outcomes.values() if v == o) for o in set(outcomes.values())}
    print(f"replayed {len(outcomes)} recorded requests with {upstream.engine}: {summary}")
    assert set(outcomes.values()) == {("reproduced", "bitwise")}, summary
