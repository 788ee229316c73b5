"""Engine commands: ``ledger engine run``, ``ledger fingerprint``, ``ledger artifact hash``.

torch and the engines are imported inside the commands, so ``ledger --help`` and every
other command work without them.
"""

from __future__ import annotations

import importlib.resources
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TransferSpeedColumn,
)

if TYPE_CHECKING:
    from workers.engine.api import Engine, GenerationRequest, GenerationResult

TINY_DEMO = "tiny-demo"
err = Console(stderr=True)


def _fail(message: str, hint: str = "check the arguments (`--help`) and docs/engine.md"
          ) -> typer.Exit:
    from ledger.cli.common import fail

    return fail(message, hint)


def read_requests(path: Path) -> list[GenerationRequest]:
    """Parse an ``engine run`` input file: one ``{"id", "prompt_token_ids", "sampling"}``
    object per line (blank lines ignored)."""
    from workers.engine.api import GenerationRequest, SamplingParams

    requests: list[GenerationRequest] = []
    seen: set[str] = set()
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                data = json.loads(line)
                unknown = set(data) - {"id", "prompt_token_ids", "sampling"}
                if unknown:
                    raise ValueError(f"unknown fields {sorted(unknown)}")
                request = GenerationRequest(
                    id=str(data["id"]),
                    prompt_token_ids=tuple(int(t) for t in data["prompt_token_ids"]),
                    sampling=SamplingParams.from_mapping(data.get("sampling") or {}),
                )
            except (ValueError, KeyError, TypeError) as exc:
                raise _fail(f"{path}:{number}: {exc}") from exc
            if request.id in seen:
                raise _fail(f"{path}:{number}: duplicate id {request.id!r}")
            seen.add(request.id)
            requests.append(request)
    return requests


def result_line(result: GenerationResult) -> str:
    """One output JSON line (floats as shortest round-trip reprs: bit-exact)."""
    out: dict[str, Any] = {
        "id": result.id,
        "token_ids": result.token_ids,
        "finish_reason": result.finish_reason,
        "logprobs": result.logprobs,
        "logits_sha256": result.logits_sha256,
    }
    if result.top_logprobs is not None:
        out["top_logprobs"] = [[[t, lp] for t, lp in step] for step in result.top_logprobs]
    return json.dumps(out, separators=(",", ":"), allow_nan=False)


def _load(engine: str, model: str, device: str, dtype: str, batch_invariant: bool,
          max_batch: int) -> Engine:
    if engine == "reference":
        from workers.engine import load_engine

        return load_engine(model, device=device, dtype=dtype, batch_invariant=batch_invariant)
    if engine == "vllm":
        if not batch_invariant:
            raise _fail("the vllm engine always runs batch invariant")
        from workers.engine.vllm_adapter import VLLMEngine

        return VLLMEngine(model, dtype=dtype, max_batch=max_batch)
    raise _fail(f"unknown engine {engine!r} (reference | vllm)")


def register(app: typer.Typer) -> None:
    """Attach the engine, fingerprint and artifact commands to the root app."""
    engine_app = typer.Typer(help="Run the replay engine on token-ID requests.",
                             no_args_is_help=True)
    artifact_app = typer.Typer(help="Model artifact hashes (the envelope's artifacts).",
                               no_args_is_help=True)

    @engine_app.command("run")
    def run(
        model: str = typer.Option(..., "--model", help="Model directory, or tiny-demo."),
        input_path: Path = typer.Option(..., "--input", exists=True, dir_okay=False,
                                        help="Requests, one JSON object per line."),
        output_path: Path = typer.Option(..., "--output", help="Results JSONL to write."),
        device: str = typer.Option("cpu", "--device", help="cpu | cuda"),
        dtype: str = typer.Option("float32", "--dtype", help="float32 | bfloat16 | float16"),
        max_batch: int = typer.Option(8, "--max-batch", min=1,
                                      help="Requests per batch, taken in file order."),
        no_batch_invariant: bool = typer.Option(
            False, "--no-batch-invariant",
            help="Ordinary fast kernels (negative control; outputs depend on co-tenants)."),
        engine_name: str = typer.Option("reference", "--engine", help="reference | vllm"),
    ) -> None:
        """Generate for every request in INPUT and write one result line per request."""
        requests = read_requests(input_path)
        if engine_name == "reference":
            from workers.engine.sampling import validate

            for request in requests:        # fail before writing anything
                try:
                    validate(request.sampling)
                except (ValueError, TypeError) as exc:
                    raise _fail(f"request {request.id!r}: {exc}") from exc
        try:
            with err.status("loading model"):
                engine = _load(engine_name, model, device, dtype, not no_batch_invariant,
                               max_batch)
        except (OSError, ValueError, RuntimeError, AssertionError, ImportError) as exc:
            raise _fail(f"cannot load {model!r} on {device}: {exc}") from exc
        from ledger.core.fingerprint import fingerprint_id

        runtime = engine.runtime()
        started, tokens = time.perf_counter(), 0
        progress = Progress(TextColumn("[bold]generating"), BarColumn(), MofNCompleteColumn(),
                            TextColumn("requests"), TimeElapsedColumn(), console=err)
        with progress, output_path.open("w", encoding="utf-8") as out:
            task = progress.add_task("generate", total=len(requests))
            for start in range(0, len(requests), max_batch):
                batch = requests[start:start + max_batch]
                try:
                    results = engine.generate(batch, max_batch=max_batch)
                except (ValueError, TypeError) as exc:
                    raise _fail(str(exc)) from exc
                for result in results:
                    out.write(result_line(result) + "\n")
                    tokens += len(result.token_ids)
                progress.advance(task, len(batch))
        seconds = time.perf_counter() - started
        err.print(
            f"{len(requests)} requests, {tokens} tokens in {seconds:.2f} s "
            f"({tokens / max(seconds, 1e-9):.1f} tok/s); batch_invariant="
            f"{runtime['batch_invariant']}; fingerprint {fingerprint_id(runtime)}"
        )

    @app.command("fingerprint")
    def fingerprint(
        engine_name: str = typer.Option("reference", "--engine", help="reference | vllm"),
        device: str = typer.Option("cpu", "--device", help="cpu | cuda"),
        dtype: str = typer.Option("float32", "--dtype", help="float32 | bfloat16 | float16"),
        no_batch_invariant: bool = typer.Option(False, "--no-batch-invariant"),
        tensor_parallel_size: int = typer.Option(1, "--tensor-parallel-size", min=1),
        threads: int = typer.Option(1, "--threads", min=1, help="torch intra-op threads on "
                                    "CPU (part of the fingerprint; `ledger worker --threads` "
                                    "takes the same value)."),
        max_num_seqs: int = typer.Option(1, "--max-num-seqs", min=1, help="vllm: the "
                                         "`vllm serve --max-num-seqs` this fingerprint is "
                                         "for (above 1: not batch invariant)."),
    ) -> None:
        """Print this node's runtime fingerprint as JSON (fingerprint_id and runtime): what
        `ledger worker` prints with the same --engine, --device, --dtype and --threads."""
        from ledger.core.fingerprint import fingerprint_id

        if engine_name not in ("reference", "vllm"):
            raise _fail(f"unknown engine {engine_name!r} (reference | vllm)")
        try:
            from workers.engine import node_runtime

            runtime = node_runtime(engine_name, device=device, dtype=dtype,
                                   batch_invariant=not no_batch_invariant, threads=threads,
                                   tensor_parallel_size=tensor_parallel_size,
                                   max_num_seqs=max_num_seqs)
        except ImportError as exc:
            raise _fail(f"{engine_name} engine unavailable: {exc}") from exc
        except (ValueError, RuntimeError, AssertionError) as exc:
            raise _fail(str(exc)) from exc
        typer.echo(json.dumps({"fingerprint_id": fingerprint_id(runtime), "runtime": runtime},
                              indent=2))

    @artifact_app.command("hash")
    def hash_directory(
        directory: str = typer.Argument(..., help="Model directory, or tiny-demo."),
        name: str | None = typer.Option(None, "--name", help="model_name to report."),
    ) -> None:
        """Print the artifact hashes of a model directory as JSON."""
        from ledger import artifacts

        if directory == TINY_DEMO:
            path = Path(str(importlib.resources.files("workers.engine") / "tiny_demo"))
            name = name or TINY_DEMO
        else:
            path = Path(directory)
        if not path.is_dir():
            raise _fail(f"{directory} is not a directory")
        progress = Progress(TextColumn("[bold]hashing"), BarColumn(), DownloadColumn(),
                            TransferSpeedColumn(), TimeElapsedColumn(), console=err,
                            transient=True)
        with progress:
            task = progress.add_task("hash", total=artifacts.total_bytes(path))
            result = artifacts.artifact_hashes(
                path, model_name=name, progress=lambda n: progress.advance(task, n)
            )
        typer.echo(json.dumps(result, indent=2))

    app.add_typer(engine_app, name="engine")
    app.add_typer(artifact_app, name="artifact")
