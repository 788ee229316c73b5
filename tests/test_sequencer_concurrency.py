"""Concurrent ingest from several API processes: the log index sequence has no gaps and no
duplicates, and every acknowledged envelope is stored exactly once."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import psycopg

from tests.conftest import provision
from tests.helpers import run_server, signed, statement


def test_three_api_processes_many_clients_gap_free_sequence(db_url: str, tmp_path) -> None:
    keys, producer = provision(db_url)
    n_clients, per_client, batch = 6, 8, 10
    payloads = [[json.dumps({"envelopes": [signed(statement(), producer)
                                           for _ in range(batch)]}).encode()
                 for _ in range(per_client)] for _ in range(n_clients)]
    # plus repeats of the same batch from two clients at once (idempotency under races)
    shared = json.dumps({"envelopes": [signed(statement(), producer) for _ in range(batch)]}
                        ).encode()
    with run_server(db_url, log_dir=tmp_path) as a, run_server(db_url, log_dir=tmp_path) as b, \
            run_server(db_url, workers=2, log_dir=tmp_path) as c:
        servers = [a.base_url, b.base_url, c.base_url]

        def client(i: int) -> list[int]:
            created: list[int] = []
            headers = {"Authorization": f"Bearer {keys['ingester']}",
                       "Content-Type": "application/json"}
            with httpx.Client(base_url=servers[i % 3], headers=headers, timeout=60) as http:
                for body in [*payloads[i], shared]:
                    r = http.post("/v1/envelopes/batch", content=body)
                    assert r.status_code == 200, r.text
                    created += [x["log_index"] for x in r.json()["results"] if x["status"] == 201]
            return created

        with ThreadPoolExecutor(n_clients) as pool:
            created = [i for part in pool.map(client, range(n_clients)) for i in part]

    total = n_clients * per_client * batch + batch
    assert sorted(created) == list(range(total)), "acknowledged indices are not 0..N-1"
    url = db_url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(url) as conn:
        idx = [r[0] for r in conn.execute("SELECT idx FROM log_entries ORDER BY idx")]
        env_idx = [r[0] for r in conn.execute("SELECT log_index FROM envelopes ORDER BY 1")]
        size = conn.execute("SELECT size FROM log_state").fetchone()
    assert idx == list(range(total))
    assert env_idx == idx
    assert size is not None and size[0] == total
