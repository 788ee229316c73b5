"""Start-up refusals: a long-running process must not run with more than its part.

``ledger serve``, ``ledger beat`` and ``ledger worker`` call :func:`enforce` (which runs
``ledger check``) before they do anything else; every problem is one line naming the
setting to change.
The database side looks at ``session_user`` (who logged in), not ``current_user``: a
``SET ROLE`` (``LEDGER_DATABASE_ROLE``) can be undone by anyone who holds the connection,
so it does not count as dropping superuser.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from sqlalchemy import Engine, text

from ledger.db.grants import COMPONENT_ROLES
from ledger.settings import Settings

COMPONENTS = ("api", "beat", "worker")
log = logging.getLogger("ledger.privileges")

_WHO = text("""
    SELECT r.rolname, r.rolsuper,
           (SELECT string_agg(pg_get_userbyid(c.relowner), ', ') FROM pg_class c
             WHERE c.oid IN (to_regclass('public.log_entries'),
                             to_regclass('public.alembic_version'))
               AND pg_has_role(r.oid, c.relowner, 'MEMBER')) AS owns,
           pg_has_role(r.oid, g.oid, 'MEMBER') AS in_group,
           r.rolcreaterole, r.rolbypassrls
      FROM pg_roles r LEFT JOIN pg_roles g ON g.rolname = :group
     WHERE r.rolname = session_user
""")


def check_runtime_role(engine: Engine, component: str) -> list[str]:
    """Problems with the login ``engine`` connects as, for ``component`` (empty: fine)."""
    group = COMPONENT_ROLES[component]
    with engine.connect() as conn:
        row = conn.execute(_WHO, {"group": group}).one()
    user, is_super, owns, in_group, create_role, bypass_rls = row
    problems = []
    if is_super:
        problems.append(f"LEDGER_DATABASE_URL logs in as {user}, a superuser: log in as a "
                        f"member of {group} (`ledger db create-login --component {component}`)")
    elif owns:
        problems.append(f"LEDGER_DATABASE_URL logs in as {user}, the schema owner ({owns}): "
                        f"log in as "
                        f"a member of {group} (`ledger db create-login --component "
                        f"{component}`)")
    elif create_role or bypass_rls:
        problems.append(f"LEDGER_DATABASE_URL logs in as {user}, which has CREATEROLE or "
                        f"BYPASSRLS: log in as a plain member of {group}")
    elif not in_group:
        problems.append(f"LEDGER_DATABASE_URL logs in as {user}, which is not a member of "
                        f"{group} (`ledger db create-login --component {component}`)")
    return problems


def insecure_dev_warning(problems: list[str]) -> str:
    """The one line ``--insecure-dev`` prints: what it allows, and what it let through."""
    found = "; ".join(problems) if problems else "none found"
    return ("WARNING: insecure dev mode (--insecure-dev / LEDGER_INSECURE_DEV): allows a "
            "superuser or schema-owner database login and a missing pepper or private key; "
            f"never use it in production. Let through: {found}")


def enforce(settings: Settings, engine: Engine, component: str, *,
            worker_key: Path | None = None, register_key: bool = False) -> None:
    """Run ``ledger check COMPONENT`` (:func:`ledger.services.checks.check`) and refuse to
    start (exit code 2, one line per problem on stderr) on any problem with this process's
    own configuration; with ``insecure_dev`` what it allows becomes one warning line.
    Other services being down now (database, broker) is a warning: processes retry."""
    from ledger.services.checks import check, refusals

    command = "serve" if component == "api" else component
    problems = check(settings, command, engine=engine, worker_key=worker_key,
                     register_key=register_key)
    refused = refusals(problems, insecure_dev=settings.insecure_dev)
    if settings.insecure_dev:
        let_through = [p.line() for p in problems if p.kind == "insecure"]
        print(insecure_dev_warning(let_through), file=sys.stderr, flush=True)
    if refused:  # only what stops it, one line each
        for p in refused:
            print(f"ledger {command}: refusing to start: {p.line()}", file=sys.stderr,
                  flush=True)
        raise SystemExit(2)
    for p in problems:
        if p.kind in ("advice", "transient"):
            print(f"ledger {command}: warning: {p.line()}", file=sys.stderr, flush=True)
