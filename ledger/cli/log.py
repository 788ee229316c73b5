"""`ledger integrate`, `ledger audit`, `ledger export`, `ledger verify`."""

from __future__ import annotations

import json
import os
import time
from datetime import datetime
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from ledger.cli.common import DatabaseUrlOption, console, fail, out, settings_with

VERIFY_CHUNK = 2_000


def _progress() -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeRemainingColumn(), console=console, transient=True)


def integrate_command(
    once: bool = typer.Option(False, help="Integrate what is pending, then exit."),
    database_url: Optional[str] = DatabaseUrlOption,  # noqa: UP045
) -> None:
    """Run the integrator (needs LEDGER_LOG_KEY_FILE): fold sequenced entries into the tree
    and publish signed checkpoints."""
    from ledger.db.session import make_engine, session_scope
    from ledger.log.integrator import integrate_all
    from ledger.log.signer import LogSigner
    from ledger.log.sink import sink_from_settings

    settings = settings_with(database_url)
    signer = LogSigner.from_settings(settings)
    if signer is None:
        raise fail("the integrator signs checkpoints", "set LEDGER_LOG_KEY_FILE to the "
                   "log's private key (PEM)")
    from ledger.replay.records import Signer

    service = Signer.from_file(settings.service_key_file, "ledger", "ledger-service")
    engine = make_engine(settings, pool_size=1)
    with session_scope(engine) as session:
        if service is not None:  # the log key's registration is then a registry leaf
            service.ensure_registered(session)
        signer.ensure_registered(session, service)
    sink = sink_from_settings(settings.checkpoint_sink_dir)
    from ledger.log.witnessing import WitnessLoop

    witnesses = None if once else WitnessLoop.from_settings(settings, engine)
    if witnesses is not None:
        witnesses.start()  # submit each checkpoint to LEDGER_WITNESSES, never blocking us
    try:
        while True:
            done = integrate_all(engine, signer, max_entries=settings.integrate_max_entries,
                                 sink=sink)
            if done:
                console.print(f"checkpoint {done[-1].tree_size} "
                              f"({sum(p.entries for p in done)} entries)")
                if witnesses is not None:
                    witnesses.wake()
            if once:
                break
            time.sleep(settings.integrate_interval_ms / 1000)
    finally:
        if witnesses is not None:
            witnesses.stop()
        engine.dispose()


def audit_command(
    against: Annotated[Optional[list[Path]], typer.Option(  # noqa: UP045
        help="A checkpoint saved outside the database (a file, or a sink directory of them); "
             "repeatable. This is what catches a consistent rewrite by someone holding the "
             "log key, and a tail deleted together with its checkpoints.")] = None,
    signatures: bool = typer.Option(False, help="Also verify every record's signatures "
                                                "(envelopes, verdicts, dispute events)."),
    trust: Annotated[Optional[Path], typer.Option(  # noqa: UP045
        help="Trust policy file (default: LEDGER_TRUST_POLICY_FILE): checkpoints count only "
             "when signed by its log keys, dispute events only by its service keys; rows "
             "of signing_keys are not believed for either.")] = None,
    witness: Annotated[Optional[list[str]], typer.Option(  # noqa: UP045
        help="A witness's URL (`ledger witness serve`); repeatable. The log must reach the "
             "size it last cosigned, with the same root: catches a truncated or rewritten "
             "tail without saved checkpoints.")] = None,
    since: Annotated[Optional[Path], typer.Option(  # noqa: UP045
        help="A signed checkpoint note audited before (a sink's or --against file, or an "
             "export's): recheck only the entries added after it, and that the stored tree "
             "up to it is the one it signed and extends to the latest checkpoint. Old "
             "records are not rehashed: run the full audit (the default) for that.")] = None,
    database_url: Optional[str] = DatabaseUrlOption,  # noqa: UP045
) -> None:
    """Recompute the log from every leaf kind's own records, cross-check every served
    column against the signed bytes and check every checkpoint; exit 1 naming the first
    bad index if anything disagrees."""
    from ledger.core.errors import LedgerError
    from ledger.core.trust import load_trust_policy
    from ledger.db.session import make_engine
    from ledger.log.audit import SinceCheckpointError, audit

    settings = settings_with(database_url)
    trust_file = trust or settings.trust_policy_file
    policy = None
    if trust_file is not None:
        try:
            policy = load_trust_policy(trust_file)
        except LedgerError as exc:
            raise fail(exc.message, "check --trust / LEDGER_TRUST_POLICY_FILE "
                       "(`ledger trust init` writes one)") from None
    saved: list[tuple[str, bytes]] = []
    for path in against or []:
        files = sorted(path.glob("checkpoint.*")) if path.is_dir() else [path]
        saved.extend((str(f), f.read_bytes()) for f in files)
    origin = policy.origin if policy is not None else settings.log_name
    try:
        witnessed = [_witness_view(url, origin) for url in witness or []]
    except LedgerError as exc:
        raise fail(exc.message, "check --witness URL") from None
    since_note = None
    if since is not None:
        try:
            since_note = since.read_bytes()
        except OSError as exc:
            raise fail(f"cannot read --since {since}: {exc.strerror}",
                       "pass a checkpoint note file") from None
    from ledger.privacy.keys import kek_from_settings

    try:
        kek = kek_from_settings(settings)
    except (OSError, ValueError) as exc:
        raise fail(f"cannot read the KEK: {exc}", "check LEDGER_KEK_FILE") from None
    engine = make_engine(settings, pool_size=1)
    try:
        with _progress() as bar:
            task = bar.add_task("auditing entries", total=None)
            report = audit(engine, settings.log_name, against=saved, signatures=signatures,
                           trust=policy, witnessed=witnessed, since=since_note, kek=kek,
                           progress=lambda done, total: bar.update(task, completed=done,
                                                                    total=total))
    except SinceCheckpointError as exc:
        raise fail(exc.message, "pass a checkpoint this log signed (a sink's or an earlier "
                   "audit's), with the same --trust; or run the full audit") from None
    finally:
        engine.dispose()
    table = Table(title="ledger audit", show_header=False)
    if report.since is not None:
        table.add_row("audited before (--since)", f"entries 0..{report.since - 1:,}: "
                      "stored tree checked against that checkpoint, records not rehashed")
        table.add_row("entries rechecked", f"{report.entries:,}")
    else:
        table.add_row("entries", f"{report.entries:,}")
    table.add_row("tree size", f"{report.tree_size:,}")
    for kind, count in sorted(report.records_checked.items()):
        table.add_row(f"{kind} records checked", f"{count:,}")
    table.add_row("disputes checked against their trails", f"{report.disputes_checked:,}")
    if report.sealed_records:
        table.add_row("envelopes encrypted at rest", f"{report.sealed_records:,}")
        table.add_row("erased envelopes (checked against tombstones)",
                      f"{report.erased_records:,}")
    table.add_row("checkpoints checked", f"{report.checkpoints:,}")
    table.add_row("saved checkpoints checked", f"{report.saved_checkpoints:,}")
    table.add_row("trust roots", f"trust policy {trust_file}" if policy is not None
                  else "signing_keys rows (pass --trust to pin them)")
    if signatures:
        table.add_row("record signatures verified", f"{report.signatures_checked:,}")
    out.print(table)
    if report.ok and report.since is not None:
        out.print(f"[green]OK: the stored tree agrees with checkpoint {report.since:,}, and "
                  "every entry, record, column, tile and checkpoint after it agrees[/green]")
        return
    if report.ok:
        out.print("[green]OK: every entry, record, column, tile and checkpoint agrees[/green]")
        return
    for problem in report.problems[:20]:
        out.print(f"[red]- {problem}[/red]", soft_wrap=True)
    if len(report.problems) > 20:
        out.print(f"[red]  ... and {len(report.problems) - 20} more[/red]")
    if report.first_bad_index is not None:
        out.print(f"[red]FAIL: first bad index {report.first_bad_index}[/red]")
    else:
        out.print("[red]FAIL[/red]")
    raise typer.Exit(1)


def _witness_view(url: str, origin: str) -> tuple[str, int, bytes]:
    """(witness name, size, root) a witness says it cosigned for ``origin`` (its ``GET /``)."""
    import base64

    import httpx

    from ledger.core.errors import LedgerError

    try:
        info = httpx.get(url.rstrip("/") + "/", timeout=10).raise_for_status().json()
        view = next((v for v in info["logs"] if v["origin"] == origin), None)
        if view is None:
            raise LedgerError(f"witness {url} does not witness the log {origin!r}")
        return str(info["name"]), int(view["size"]), base64.b64decode(view["root_hash"])
    except (httpx.HTTPError, KeyError, TypeError, ValueError) as exc:
        raise LedgerError(f"witness {url}: {exc}") from None


def export_command(
    out_path: Annotated[Path, typer.Option("--out", help="Bundle file to write (JSON Lines).")],
    recorded_after: Optional[datetime] = typer.Option(None, help="RFC 3339, inclusive."),  # noqa: UP045
    recorded_before: Optional[datetime] = typer.Option(None, help="RFC 3339, exclusive."),  # noqa: UP045
    model_sha256: Optional[str] = typer.Option(None),  # noqa: UP045
    fingerprint_id: Optional[str] = typer.Option(None),  # noqa: UP045
    request_id: Annotated[Optional[list[str]], typer.Option(help="Repeatable.")] = None,  # noqa: UP045
    allow_empty: bool = typer.Option(False, help="Write a bundle of zero records without "
                                     "failing (a selection that matched nothing)."),
    database_url: Optional[str] = DatabaseUrlOption,  # noqa: UP045
) -> None:
    """Write a self-contained bundle: envelopes, inclusion proofs against one checkpoint,
    the checkpoint and the public keys. `ledger verify` checks it offline."""
    from ledger.db.session import make_engine
    from ledger.log.export import Selection, write_bundle

    settings = settings_with(database_url)
    engine = make_engine(settings, pool_size=2)
    selection = Selection(recorded_after, recorded_before, model_sha256, fingerprint_id,
                          tuple(request_id or ()))
    tmp = out_path.with_suffix(out_path.suffix + ".part")
    with tmp.open("wb") as fh, _progress() as bar:
        bar.add_task("exporting", total=None)
        n = write_bundle(engine, selection, fh)
    engine.dispose()
    if n == 0 and not allow_empty:
        tmp.unlink(missing_ok=True)
        console.print(f"[yellow]warning: the selection matched no records; {out_path} was not "
                      "written[/yellow]")
        raise fail("nothing to export", "check the filters (e.g. --model-sha256 is the "
                   "artifact hash `ledger artifact hash` prints), or pass --allow-empty")
    os.replace(tmp, out_path)
    console.print(f"[green]wrote {out_path}: {n} records[/green]")


def verify_command(
    bundle: Annotated[Path, typer.Argument(help="A bundle written by `ledger export`.")],
    trust: Annotated[Optional[Path], typer.Option(  # noqa: UP045
        help="Trust policy (TOML, `ledger trust init`): only its log keys and service keys "
             "are believed, producer and worker keys only when the bundle's registry "
             "records vouch for them. Default: LEDGER_TRUST_POLICY_FILE.")] = None,
    log_key: Annotated[Optional[list[str]], typer.Option(  # noqa: UP045
        help="Without a trust policy: pin the log's verifier key (name+hash+key); without "
             "either, the keys the bundle names are used, which proves integrity but not "
             "origin.")] = None,
    processes: int = typer.Option(
        0, "--processes", "--jobs", min=0,
        help="Worker processes verifying signatures (0: one per CPU for a bundle over 4 MB, "
             "else one)."),
) -> None:
    """Verify a bundle offline: the signed manifest covering every byte, the checkpoint
    signature (and witness quorum), every record's signature and inclusion proof. No
    database, no network. The bundle is read as a stream, in memory that does not grow
    with its size. Exit 1 naming what is wrong."""
    from ledger.core.bundle import verify_file
    from ledger.core.errors import LedgerError
    from ledger.core.note import parse_verifier_key
    from ledger.core.trust import load_trust_policy

    started = time.perf_counter()
    try:
        policy_file = trust or settings_with(None).trust_policy_file
        policy = load_trust_policy(policy_file) if policy_file is not None else None
        pinned = [parse_verifier_key(k) for k in log_key] if log_key and not policy else None
        size = bundle.stat().st_size
        workers = processes or ((os.cpu_count() or 1) if size > 4 * 1024 * 1024 else 1)
        with _progress() as bar:
            task = bar.add_task("verifying records", total=_announced_records(bundle))
            summary = verify_file(bundle, trust=policy, pinned_log_keys=pinned,
                                  on_records=lambda n: bar.advance(task, n),
                                  processes=workers, chunk=VERIFY_CHUNK)
    except FileNotFoundError as exc:
        raise fail(f"{exc.strerror}: {exc.filename}", "pass the bundle `ledger export "
                   "--out` wrote") from None
    except (LedgerError, OSError) as exc:
        message = exc.message if isinstance(exc, LedgerError) else str(exc)
        out.print(f"[red]FAIL: {message}[/red]", soft_wrap=True)
        raise typer.Exit(1) from None
    elapsed = time.perf_counter() - started
    table = Table(title=f"ledger verify {bundle.name}", show_header=False)
    table.add_row("log", summary.origin)
    table.add_row("checkpoint tree size", f"{summary.tree_size:,}")
    table.add_row("checkpoint root", summary.root_hash)
    table.add_row("log key", {"trust": f"from the trust policy {policy_file}",
                              "pinned": "pinned"}.get(
        summary.log_key_source,
        "from the bundle (pass --trust POLICY to prove origin)"))
    if summary.witnesses:
        table.add_row("witnesses", ", ".join(summary.witnesses))
    table.add_row("selection", json.dumps(summary.selection, sort_keys=True))
    table.add_row("exported at", summary.created_at)
    for kind, count in sorted(summary.by_kind.items()):
        table.add_row(f"{kind} records verified", f"{count:,}")
    for kid, purpose in sorted(summary.keys.items(), key=lambda kv: (kv[1], kv[0])):
        table.add_row(f"{purpose} key", kid)
    table.add_row("time", f"{elapsed:.2f} s ({summary.records / max(elapsed, 1e-9):,.0f}/s)")
    out.print(table)
    out.print("[green]OK: the signed manifest covers every byte; checkpoint signature, every "
              "signature and every inclusion proof verify[/green]")


def _announced_records(bundle: Path) -> int | None:
    """The record count the header announces, for the progress bar only (verified later)."""
    import orjson

    try:
        with bundle.open("rb") as fh:
            count = orjson.loads(fh.readline()).get("records")
    except (OSError, orjson.JSONDecodeError, AttributeError):
        return None
    return count if isinstance(count, int) and count >= 0 else None


def register(app: typer.Typer) -> None:
    app.command("integrate")(integrate_command)
    app.command("audit")(audit_command)
    app.command("export")(export_command)
    app.command("verify")(verify_command)



