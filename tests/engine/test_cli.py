"""``ledger engine run``, ``ledger fingerprint`` and ``ledger artifact hash``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from ledger.cli.main import app
from ledger.core.fingerprint import FINGERPRINT_FIELDS, fingerprint_id
from tests.engine.test_artifacts import TINY_DEMO_SHA256
from workers.engine import load_engine
from workers.engine.api import GenerationRequest, SamplingParams

runner = CliRunner()

REQUESTS = [
    {"id": "greedy", "prompt_token_ids": [256, 72, 101, 108, 108, 111],
     "sampling": {"max_tokens": 5, "logprobs": 2}},
    {"id": "sampled", "prompt_token_ids": [256, 87],
     "sampling": {"temperature": 0.8, "seed": 7, "top_p": 0.9, "max_tokens": 6}},
    {"id": "stop", "prompt_token_ids": [1, 2, 3],
     "sampling": {"max_tokens": 4, "stop_token_ids": [13]}},
]


def write_requests(path: Path, requests: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in requests))
    return path


def test_engine_run_tiny_demo_round_trips_bits(tmp_path: Path) -> None:
    src = write_requests(tmp_path / "in.jsonl", REQUESTS)
    out = tmp_path / "out.jsonl"
    result = runner.invoke(app, ["engine", "run", "--model", "tiny-demo", "--input", str(src),
                                 "--output", str(out), "--max-batch", "2"])
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["id"] for line in lines] == ["greedy", "sampled", "stop"]
    assert set(lines[0]) == {"id", "token_ids", "finish_reason", "logprobs", "logits_sha256",
                             "top_logprobs"}
    assert "top_logprobs" not in lines[1]
    engine = load_engine("tiny-demo")
    direct = engine.generate([GenerationRequest(r["id"], tuple(r["prompt_token_ids"]),
                                                SamplingParams.from_mapping(r["sampling"]))
                              for r in REQUESTS], max_batch=2)
    for line, want in zip(lines, direct, strict=True):
        assert line["token_ids"] == want.token_ids
        assert [x.hex() for x in line["logprobs"]] == [x.hex() for x in want.logprobs]
        assert line["logits_sha256"] == want.logits_sha256
        assert len(line["logits_sha256"]) == len(line["token_ids"])


def test_engine_run_negative_control_flag(tmp_path: Path) -> None:
    src = write_requests(tmp_path / "in.jsonl", REQUESTS[:1])
    result = runner.invoke(app, ["engine", "run", "--model", "tiny-demo", "--input", str(src),
                                 "--output", str(tmp_path / "o.jsonl"),
                                 "--no-batch-invariant", "--dtype", "bfloat16"])
    assert result.exit_code == 0, result.output
    assert "batch_invariant=False" in result.output


def test_engine_run_reports_bad_lines(tmp_path: Path) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps(REQUESTS[0]) + "\n" + '{"id": "x", "prompt_token_ids": [1],'
                   ' "sampling": {"temprature": 1}}\n')
    result = runner.invoke(app, ["engine", "run", "--model", "tiny-demo", "--input", str(src),
                                 "--output", str(tmp_path / "o.jsonl")])
    assert result.exit_code == 2
    assert "in.jsonl:2" in result.output and "temprature" in result.output


def test_fingerprint_command() -> None:
    result = runner.invoke(app, ["fingerprint"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert set(FINGERPRINT_FIELDS) <= set(data["runtime"])
    assert data["fingerprint_id"] == fingerprint_id(data["runtime"])
    assert data["runtime"]["batch_invariant"] is True
    assert data["runtime"]["engine"] == "reference" and data["runtime"]["device"] == "cpu"
    fast = json.loads(runner.invoke(app, ["fingerprint", "--no-batch-invariant"]).stdout)
    assert fast["fingerprint_id"] != data["fingerprint_id"]
    bf16 = json.loads(runner.invoke(app, ["fingerprint", "--dtype", "bfloat16"]).stdout)
    assert bf16["fingerprint_id"] != data["fingerprint_id"]
    assert load_engine("tiny-demo").runtime() | {"hostname": None} == \
        data["runtime"] | {"hostname": None}


def test_artifact_hash_command(tmp_path: Path) -> None:
    result = runner.invoke(app, ["artifact", "hash", "tiny-demo"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == {"model_sha256": TINY_DEMO_SHA256,
                                         "tokenizer_sha256": None,
                                         "chat_template_sha256": None,
                                         "model_name": "tiny-demo"}
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "w.bin").write_bytes(b"x" * 3_000_000)
    data = json.loads(runner.invoke(app, ["artifact", "hash", str(tmp_path / "model")]).stdout)
    assert data["model_name"] == "model"


def test_cli_help_does_not_import_torch() -> None:
    code = ("import sys; from typer.testing import CliRunner; from ledger.cli.main import app;"
            "r = CliRunner().invoke(app, ['engine', '--help']); assert r.exit_code == 0;"
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
