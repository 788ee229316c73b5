"""Start-up refusals: a long-running process must not run with more than its part.

``ledger serve``, ``ledger beat`` and ``ledger worker`` call :func:`startup_problems`
before they do anything else; every problem is one line naming the setting to change.
The database side looks at ``session_user`` (who logged in), not ``current_user``: a
``SET ROLE`` (``LEDGER_DATABASE_ROLE``) can be undone by anyone who holds the connection,
so it does not count as dropping superuser.
"""

from __future__ import annotations

import logging
import sys

from sqlalchemy import Engine, text
from sqlalchemy.exc import OperationalError

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


def settings_problems(settings: Settings, component: str, *,
                      worker_key_given: bool = False) -> list[str]:
    """The secrets ``component`` needs to do its part, one line per missing setting."""
    problems = []
    if component == "api":
        if not settings.api_key_pepper.get_secret_value():
            problems.append("set LEDGER_API_KEY_PEPPER to a long random secret (API keys are "
                            "stored as HMAC-SHA256 with it)")
        if settings.integrate_in_api and settings.log_key_file is None:
            problems.append("set LEDGER_LOG_KEY_FILE to the log's private key, or "
                            "LEDGER_INTEGRATE_IN_API=false where `ledger beat` integrates")
    elif component == "beat":
        if settings.log_key_file is None:
            problems.append("set LEDGER_LOG_KEY_FILE to the log's private key (the beat "
                            "runs the integrator)")
    elif component == "worker" and settings.worker_key_file is None and not worker_key_given:
        problems.append("set LEDGER_WORKER_KEY_FILE (or --key) to this worker's private key")
    return problems


def startup_problems(settings: Settings, engine: Engine, component: str, *,
                     worker_key_given: bool = False) -> list[str]:
    """Settings first (no database needed to say a secret is missing), then the login.
    A database that cannot be reached is not a problem here: the process's own retry
    logic handles outages."""
    problems = settings_problems(settings, component, worker_key_given=worker_key_given)
    try:
        problems += check_runtime_role(engine, component)
    except OperationalError as exc:
        log.warning("could not check the database login (%s); the database is unreachable "
                    "now", type(exc).__name__)
    return problems


def insecure_dev_warning(problems: list[str]) -> str:
    """The one line ``--insecure-dev`` prints: what it allows, and what it let through."""
    found = "; ".join(problems) if problems else "none found"
    return ("WARNING: insecure dev mode (--insecure-dev / LEDGER_INSECURE_DEV): allows a "
            "superuser or schema-owner database login and a missing pepper or private key; "
            f"never use it in production. Let through: {found}")


def enforce(settings: Settings, engine: Engine, component: str, *,
            worker_key_given: bool = False) -> None:
    """Refuse to start (exit code 2, one line per problem on stderr) unless the process
    has exactly its part; with ``insecure_dev`` print one warning line instead."""
    problems = startup_problems(settings, engine, component, worker_key_given=worker_key_given)
    if settings.insecure_dev:
        print(insecure_dev_warning(problems), file=sys.stderr, flush=True)
        return
    if problems:
        for line in problems:
            command = "serve" if component == "api" else component
            print(f"ledger {command}: refusing to start: {line}", file=sys.stderr,
                  flush=True)
        raise SystemExit(2)
