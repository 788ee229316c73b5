"""`ledger verify` in constant memory (issue 17, acceptance 3).

Builds bundles of N small signed envelopes (``tests.helpers.statement`` with 8 prompt and
4 output tokens, ~2.8 KB per record line; ``--tokens 512/128`` gives the 18 KB envelopes
of benchmarks/log.py) offline: the same line format, inclusion
proofs against one signed checkpoint and a manifest signed by a service key that
``ledger export`` writes, but no database (a 200k-envelope log would take longer to ingest
than to verify). The bundle is built in parallel worker processes and streamed to disk
(:func:`build_bundle`), so one larger than this machine's memory can be made. Then, for
each size, it runs ``ledger verify BUNDLE --processes P`` as a child process and reports:

- peak memory of the verifier: the largest peak RSS of any of its processes (VmHWM, the
  main process in practice) and the peak PSS of the whole process tree (main + workers,
  summed), from /proc: the first every 20 ms, the second every second (reading it
  costs the verifier throughput; see :func:`measure`, and there why not ``wait4``'s
  ``ru_maxrss``);
- throughput: records / the seconds the verifier reports for reading and verifying (the
  command's "time" row; interpreter and import start-up, ~0.5-1 s, excluded; the wall
  time of the whole command is printed too);
- the same-run per-record floor (the issue's): libsodium's Ed25519 verification of the
  record's PAE (PyNaCl's ``crypto_sign_open``; since 2026-12-02 the verifier calls the
  same libsodium function through PyNaCl's binding without an output buffer, which
  spares the copies of the message the floor's call still makes, ~1.5 us a record:
  ``ledger.core.keys._crypto_sign_open``), SHA-256 of its DSSE bytes and an
  ``orjson`` parse of its signed statement (and, as a second, stricter column, the floor
  with an ``orjson`` parse of the record line instead: :data:`FLOOR_PARSES`), on a
  sample of the bundle's records, in as many processes
  at once as the verifier ran, 3 s right before and right after each run (on a shared
  machine the load changes by the minute: the two are averaged, and of ``--rounds`` runs
  the one of median ratio is reported);
- with ``--baseline``, the in-memory verifier that preceded the streaming one (main at
  7f03350, ``ledger/core/bundle.py`` loaded from git), its peak RSS and throughput (it
  holds the whole bundle: never with a bundle near the machine's memory).

    python benchmarks/verify.py [--sizes 10000,50000,200000] [--processes 1,2] [--baseline]
                                [--tokens 8/4] [--keep DIR] [--build-only]

Larger than memory (24 GiB here): 1,400,000 envelopes of 512/128 tokens are ~26 GB,

    python benchmarks/verify.py --sizes 1400000 --tokens 512/128 --processes 2 \
        --rounds 1 --keep /var/tmp/ledger-verify
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import machine, table

REPO = Path(__file__).resolve().parent.parent
ORIGIN = "bench.example/verify"
BASELINE_COMMIT = "7f03350"


def _b64(b: bytes) -> str:
    return base64.b64encode(b).decode()


class Tree:
    """Every full subtree's hash, level by level, so a proof is lookups, not rehashing."""

    def __init__(self, leaves: list[bytes]) -> None:
        from ledger.core.merkle import node_hash

        self.size = len(leaves)
        self.levels = [leaves]
        while len(self.levels[-1]) > 1:
            prev = self.levels[-1]
            self.levels.append([node_hash(prev[i], prev[i + 1])
                                for i in range(0, len(prev) - 1, 2)])
        self.memo: dict[tuple[int, int], bytes] = {}

    def hash(self, lo: int, hi: int) -> bytes:
        from ledger.core.merkle import node_hash

        width = hi - lo
        if width & (width - 1) == 0 and lo % width == 0:
            return self.levels[width.bit_length() - 1][lo // width]
        found = self.memo.get((lo, hi))
        if found is None:
            k = 1 << ((width - 1).bit_length() - 1)
            found = node_hash(self.hash(lo, lo + k), self.hash(lo + k, hi))
            self.memo[(lo, hi)] = found
        return found

    def proof(self, index: int) -> list[bytes]:
        from ledger.core.merkle import inclusion_proof_ranges

        return [self.hash(lo, hi) for lo, hi in inclusion_proof_ranges(index, self.size)]


_BUILD: dict[str, Any] = {}
"""What the builder's worker processes inherit by fork: the payload template, the producer
key, and (second pass) the signatures and the tree."""
RID_WIDTH = 12


def _rid(i: int) -> bytes:
    return b"req-%0*d" % (RID_WIDTH, i)


def _payload(i: int) -> bytes:
    return _rid(i).join(_BUILD["template"])


def _envelope(i: int, sig: bytes) -> Any:
    import pybase64

    from ledger.core import dsse

    return dsse.Envelope(dsse.PAYLOAD_TYPE_INTOTO, pybase64.b64encode(_payload(i)).decode(),
                         b"", (dsse.Signature(_BUILD["kid"], sig, _b64(sig)),))


def _sign_range(bounds: tuple[int, int]) -> tuple[int, bytes, bytes]:
    """First pass, in a worker: sign records lo..hi-1; their leaf hashes and signatures."""
    from ledger.core import dsse
    from ledger.core.logentry import log_entry_bytes
    from ledger.core.merkle import leaf_hash

    lo, hi = bounds
    key = _BUILD["key"]
    leaves, sigs = bytearray(), bytearray()
    for i in range(lo, hi):
        sig = key.sign(dsse.pae(dsse.PAYLOAD_TYPE_INTOTO, _payload(i)))
        d = _envelope(i, sig).canonical_bytes()
        leaves += leaf_hash(log_entry_bytes("envelope", _rid(i).decode(),
                                            hashlib.sha256(d).hexdigest()))
        sigs += sig
    return lo, bytes(leaves), bytes(sigs)


def _lines_range(bounds: tuple[int, int]) -> tuple[bytes, bytes]:
    """Second pass, in a worker: the record lines lo..hi-1 (signatures from the first)
    and their line digests (what the manifest's records digest is made of)."""
    from ledger.core.bundle import dsse_line_digest, record_prefix, record_suffix

    lo, hi = bounds
    sigs, tree = _BUILD["sigs"], _BUILD["tree"]
    out, digests = bytearray(), bytearray()
    for i in range(lo, hi):
        d = _envelope(i, sigs[64 * i:64 * i + 64]).canonical_bytes()
        prefix = record_prefix(i, "envelope", _rid(i).decode())
        suffix = record_suffix(b"[%s]" % b",".join(b'"%s"' % base64.b64encode(h)
                                                   for h in tree.proof(i)))
        out += b"%s%s%s\n" % (prefix, d, suffix)
        digests += dsse_line_digest(prefix, hashlib.sha256(d).hexdigest(), suffix)
    return bytes(out), bytes(digests)


def build_bundle(path: Path, n: int, prompt_len: int = 8, output_len: int = 4,
                 processes: int | None = None, block: int = 2000) -> None:
    """A bundle of ``n`` envelope records (no admin events: the manifest's key table
    vouches for the producer key, as an export without a trust policy is verified), built
    in ``processes`` worker processes (default: one per core) and never held in memory.

    Every record is a distinct statement (its own request ID, ``req-%012d``, spliced into
    one canonical payload where the request ID stands, at a fixed width, so the bytes stay
    RFC 8785) signed by the same producer key. Two passes: the workers sign each record
    and return its leaf hash and signature (96 bytes a record are kept); the tree and the
    signed checkpoint are made; then the workers write the record lines again from the
    signatures, with their inclusion proofs and line digests, in order, and this process
    folds the digests into the manifest's and writes the lines after a header of known
    length, which is written last."""
    import multiprocessing as mp

    from ledger.core.bundle import FORMAT, header_bytes
    from ledger.core.canonical import canonical_json
    from ledger.core.keys import generate_private_key, key_id, public_raw
    from ledger.core.note import Checkpoint, format_verifier_key, sign_checkpoint
    from ledger.core.statements import bundle_statement
    from ledger.producer import sign_statement
    from tests.helpers import statement

    if n >= 10**RID_WIDTH:
        raise SystemExit(f"at most {10**RID_WIDTH - 1} records")
    producer, service, log_key = (generate_private_key() for _ in range(3))
    template = canonical_json(statement(_rid(0).decode(), prompt_len=prompt_len,
                                        output_len=output_len))
    # the request ID is the predicate's request_id and the subject's name
    assert template.count(b'"request_id":"%s"' % _rid(0)) == 1
    assert template.count(b'"name":"%s"' % _rid(0)) == 1 and template.count(_rid(0)) == 2
    pub = public_raw(producer)
    _BUILD.update(template=template.split(_rid(0)), key=producer, kid=key_id(pub))
    bounds = [(lo, min(lo + block, n)) for lo in range(0, n, block)]
    procs = processes or os.cpu_count() or 1
    ctx = mp.get_context("fork")
    leaves = bytearray(32 * n)
    sigs = bytearray(64 * n)
    with ctx.Pool(procs) as pool:
        for lo, lv, sg in pool.imap_unordered(_sign_range, bounds):
            leaves[32 * lo:32 * lo + len(lv)] = lv
            sigs[64 * lo:64 * lo + len(sg)] = sg
    tree = Tree([bytes(leaves[32 * i:32 * i + 32]) for i in range(n)])
    del leaves
    root = tree.hash(0, n) if n else hashlib.sha256(b"").digest()
    note = sign_checkpoint(Checkpoint(ORIGIN, n, root), ORIGIN, log_key)
    manifest = {
        "format": FORMAT, "origin": ORIGIN, "checkpoint": note.decode(),
        "log_keys": [format_verifier_key(ORIGIN, log_key.public_key())],
        "service_keys": [_b64(public_raw(service))],
        "keys": [{"keyid": key_id(pub), "public_key": _b64(pub), "purpose": "producer",
                  "name": "bench", "status": "active", "not_before": "2026-01-01T00:00:00Z",
                  "not_after": None, "revoked_at": None}],
        "selection": {"benchmark": "verify"}, "records": n,
        "created_at": datetime.now(UTC).isoformat(),
    }

    def header(digest_hex: str) -> bytes:
        env = sign_statement(bundle_statement(records_sha256=digest_hex,
                                              predicate=manifest), service)
        return header_bytes(n, env) + b"\n"

    head_len = len(header("0" * 64))  # every field of fixed width: the real one is as long
    _BUILD.update(sigs=bytes(sigs), tree=tree)
    del sigs
    digest = hashlib.sha256()
    with path.open("wb") as out, ctx.Pool(procs) as pool:
        out.seek(head_len)
        # at most two blocks per worker ahead of the writer (``imap`` would queue every
        # finished block here if writing were the slower side: the whole bundle)
        pending: deque[Any] = deque()
        for b in bounds:
            if len(pending) >= 2 * procs:
                blob, digests = pending.popleft().get()
                digest.update(digests)
                out.write(blob)
            pending.append(pool.apply_async(_lines_range, (b,)))
        while pending:
            blob, digests = pending.popleft().get()
            digest.update(digests)
            out.write(blob)
        head = header(digest.hexdigest())
        assert len(head) == head_len
        out.seek(0)
        out.write(head)
    _BUILD.clear()


def _floor_items(path: Path, sample: int) -> tuple[bytes, list[tuple[bytes, bytes, bytes,
                                                                     bytes, bytes]]]:
    import orjson

    from ledger.core import dsse

    with path.open("rb") as fh:
        head = orjson.loads(fh.readline())
        lines = [fh.readline().rstrip(b"\n") for _ in range(sample)]
    lines = [x for x in lines if x]
    pred = orjson.loads(base64.b64decode(head["manifest"]["payload"]))["predicate"]
    pub = base64.b64decode(pred["keys"][0]["public_key"])
    items = []
    for line in lines:
        env = dsse.envelope_from_obj(orjson.loads(line)["dsse"])
        items.append((line, env.pae(), env.signatures[0].sig, env.canonical_bytes(),
                      env.payload))
    return pub, items


def _floor_loop(args: tuple[Path, int, float, str]) -> float:
    """Records per second of the floor work, repeated over the sample for ``seconds``."""
    import nacl.bindings
    import orjson

    path, sample, seconds, parse = args
    pub, items = _floor_items(path, sample)
    verify = nacl.bindings.crypto_sign_open
    done, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for line, pae, sig, dsse_bytes, payload in items:
            orjson.loads(payload if parse == "statement" else line)
            hashlib.sha256(dsse_bytes).digest()
            verify(sig + pae, pub)
        done += len(items)
    return done / (time.perf_counter() - t0)


#: What the floor parses with orjson: the signed statement (the issue's floor: its
#: "orjson parse 15-38 us (stdlib json 105-160 us)" is the statement's, whose 640 numbers
#: and 128 digests cost stdlib json that much; a verifier must parse it, to check the
#: record it names) or the record line (this benchmark's floor until 2026-12-02: a few
#: long strings, 6-7 us, less than the statement's 15-16 us on the VM).
FLOOR_PARSES = ("statement", "line")


def floor_rate(path: Path, processes: int, sample: int = 2000, seconds: float = 3.0,
               parse: str = "statement") -> float:
    """The per-record floor (libsodium's Ed25519 verify of the PAE + SHA-256 of the DSSE
    bytes + an orjson parse of the signed statement, or with ``parse="line"`` of the
    record line), records/s of ``processes`` processes doing only that at the same time:
    on a shared machine this is what the cores give now, not what they would give
    idle."""
    if processes <= 1:
        return _floor_loop((path, sample, seconds, parse))
    import multiprocessing as mp

    with mp.get_context("fork").Pool(processes) as pool:
        return sum(pool.map(_floor_loop, [(path, sample, seconds, parse)] * processes))


def _tree_memory(pid: int, pss: bool = True) -> tuple[int, int]:
    """(sum of the proportional set sizes of ``pid`` and its descendants, or 0 without
    ``pss``; the largest peak RSS (VmHWM) among them), bytes, from /proc: pages shared
    after fork are counted once across the processes in the first, once per process in
    the second."""
    total, hwm, todo = 0, 0, [pid]
    while todo:
        p = todo.pop()
        try:
            if pss:
                with open(f"/proc/{p}/smaps_rollup") as fh:
                    for line in fh:
                        if line.startswith("Pss:"):
                            total += int(line.split()[1]) * 1024
                            break
            with open(f"/proc/{p}/status") as fh:
                for line in fh:
                    if line.startswith("VmHWM:"):
                        hwm = max(hwm, int(line.split()[1]) * 1024)
                        break
            with open(f"/proc/{p}/task/{p}/children") as fh:
                todo.extend(int(c) for c in fh.read().split())
        except (OSError, ValueError):
            continue
    return total, hwm


#: How often :func:`measure` reads the processes' PSS. ``smaps_rollup`` makes the kernel
#: walk the page tables of a process's whole mapping of the bundle: read every 20 ms for
#: the three processes of a 2-process run, it took 20-30% of the verifier's throughput
#: on the 2-core VM (9,276-10,695 against 12,771-13,228 records/s without it, the same
#: minutes, 2026-12-02). The peak RSS (VmHWM, which the kernel keeps) costs nothing to
#: read and is still read every 20 ms.
PSS_EVERY_S = 1.0


def measure(argv: Sequence[str]) -> tuple[float, float, int, int]:
    """Run ``argv``; (wall seconds, seconds the command reports for verifying alone (its
    last stdout line ``time: S``, or the verify table's time row), the largest peak RSS of
    any of its processes, the peak of their summed PSS), memory in bytes, from /proc:
    peak RSS every 20 ms, PSS every :data:`PSS_EVERY_S`. Not ``wait4``'s ``ru_maxrss``:
    Linux carries a process's peak RSS across ``execve``, so a child spawned by this
    (large) process reports this one's RSS when its own is smaller (the unexplained
    244 MB of the 1,000,000-envelope run)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**os.environ, "COLUMNS": "200"})
    peak_pss = peak_hwm = 0
    pss_at = t0
    while True:
        pid, status, _ = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        now = time.perf_counter()
        pss, hwm = _tree_memory(proc.pid, pss=now >= pss_at)
        if now >= pss_at:
            pss_at = now + PSS_EVERY_S
        peak_pss, peak_hwm = max(peak_pss, pss), max(peak_hwm, hwm)
        time.sleep(0.02)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    err = proc.stderr.read().decode() if proc.stderr else ""
    text = proc.stdout.read().decode() if proc.stdout else ""
    if proc.returncode:
        raise SystemExit(f"{' '.join(argv)} failed ({proc.returncode}): {err[-2000:]}")
    found = re.search(r"time\s*│?\s*:?\s*([0-9.]+) s", text) or re.search(
        r"^time: ([0-9.]+)", text, re.M)
    inner = float(found.group(1)) if found else wall
    return wall, inner, peak_hwm, peak_pss


BASELINE = """
import importlib.util, multiprocessing as mp, sys
from concurrent.futures import ProcessPoolExecutor
import time
t0 = time.perf_counter()
spec = importlib.util.spec_from_file_location("old_bundle", sys.argv[1])
mod = importlib.util.module_from_spec(spec); sys.modules["old_bundle"] = mod
spec.loader.exec_module(mod)
data = open(sys.argv[2], "rb").read()
procs = int(sys.argv[3])
if procs > 1:
    with ProcessPoolExecutor(procs, mp_context=mp.get_context("fork")) as pool:
        s = mod.verify_bundle(data, map_chunks=pool.map, chunk=2000)
else:
    s = mod.verify_bundle(data, chunk=2000)
assert s.records > 0
print(f"time: {time.perf_counter() - t0:.3f}")
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="10000,50000,200000")
    ap.add_argument("--processes", default="1,2")
    ap.add_argument("--baseline", action="store_true",
                    help=f"also run the in-memory verifier of {BASELINE_COMMIT}")
    ap.add_argument("--keep", help="directory to keep the bundles in")
    ap.add_argument("--rounds", type=int, default=3,
                    help="runs of each verifier; each between two floor measurements, the "
                         "round of median ratio reported, peak memory the largest of all")
    ap.add_argument("--tokens", default="8/4",
                    help="prompt/output tokens per envelope (512/128: the 18 KB envelopes "
                         "of benchmarks/log.py)")
    ap.add_argument("--build-processes", type=int, default=os.cpu_count() or 1,
                    help="worker processes that build a bundle")
    ap.add_argument("--build-only", action="store_true",
                    help="build the bundles (into --keep) and stop")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    procs = [int(p) for p in args.processes.split(",")]
    prompt_len, output_len = (int(x) for x in args.tokens.split("/"))
    rows: list[list[Any]] = []
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(args.keep or tmpdir)
        tmp.mkdir(parents=True, exist_ok=True)
        old = tmp / "old_bundle.py"
        if args.baseline:
            old.write_bytes(subprocess.run(
                ["git", "show", f"{BASELINE_COMMIT}:ledger/core/bundle.py"], cwd=REPO,
                check=True, capture_output=True).stdout)
        for n in sizes:
            bundle = tmp / f"bundle-{n}-{prompt_len}-{output_len}.jsonl"
            t0 = time.perf_counter()
            if not bundle.exists():
                part = bundle.with_suffix(".part")
                build_bundle(part, n, prompt_len, output_len, args.build_processes)
                part.rename(bundle)
            built = time.perf_counter() - t0
            mb = bundle.stat().st_size / 1e6
            print(f"{n:,} envelopes: {mb:,.0f} MB bundle, built in {built:.0f} s",
                  file=sys.stderr)
            if args.build_only:
                continue
            for p in procs:
                runs = [("streaming `ledger verify`",
                         [sys.executable, "-m", "ledger.cli.main", "verify", str(bundle),
                          "--processes", str(p)])]
                if args.baseline:
                    runs.append((f"in-memory verifier ({BASELINE_COMMIT})",
                                 [sys.executable, "-c", BASELINE, str(old), str(bundle),
                                  str(p)]))
                for label, argv in runs:
                    rounds = []
                    for _ in range(args.rounds):
                        load = os.getloadavg()[0]
                        before = [floor_rate(bundle, p, parse=f) for f in FLOOR_PARSES]
                        wall, inner, main_rss, tree_rss = measure(argv)
                        floor, line_floor = ((b + floor_rate(bundle, p, parse=f)) / 2
                                             for b, f in zip(before, FLOOR_PARSES,
                                                             strict=True))
                        rounds.append((n / inner / floor, n / inner, floor, line_floor, wall,
                                       main_rss, tree_rss, load))
                    rounds.sort()
                    # the round of median ratio (to the statement-parse floor)
                    _, rate, floor, line_floor, wall, _, _, load = rounds[len(rounds) // 2]
                    main_rss = max(r[5] for r in rounds)
                    tree_rss = max(r[6] for r in rounds)
                    rows.append([f"{n:,}", f"{mb:,.0f}", label, p, f"{main_rss / 1e6:.0f}",
                                 f"{tree_rss / 1e6:.0f}", f"{wall:.1f}", f"{rate:,.0f}",
                                 f"{floor:,.0f}", f"{rate / floor:.2f}",
                                 f"{line_floor:,.0f}", f"{rate / line_floor:.2f}",
                                 f"{load:.1f}"])
                    print(" | ".join(str(c) for c in rows[-1]), file=sys.stderr)
    if args.build_only:
        return
    print(f"\n{machine()}\n")
    print(table(["envelopes", "bundle MB", "verifier", "processes", "peak RSS, largest process MB",
                 "peak PSS all processes MB", "wall s", "records/s",
                 "floor records/s (statement parse)", "ratio to floor",
                 "floor records/s (line parse)", "ratio to line-parse floor",
                 "load average (1 min) at start"], rows))


if __name__ == "__main__":
    main()
