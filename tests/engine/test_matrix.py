"""``ledger matrix run``: the replay matrix over stored records (envelopes file source).

Records are recorded here by the invariant engine (tiny-demo, bf16, one at a time) and
signed like the demo's; one record is altered at token 4 before signing (a compromised
gateway). The matrix must report: every invariant cell bitwise for the honest records; the
altered record diverged at exactly 4 in every cell; the default kernels (the deliberately
non-invariant axis) not bitwise, with first divergence positions equal to those computed
independently from a default-mode run of the same configuration.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from typer.testing import CliRunner  # noqa: E402

from ledger.cli.main import app  # noqa: E402
from ledger.replay.matrix import Replayed, compare, first_divergence  # noqa: E402
from workers.engine import load_engine  # noqa: E402
from workers.engine.api import GenerationRequest, SamplingParams  # noqa: E402
from workers.engine.matrix import _replay, _requests, parse_cell  # noqa: E402

ALTERED = "rec-3"


def _record(tmp_path: Path) -> tuple[Path, list[GenerationRequest], list[dict]]:
    from ledger.artifacts import artifact_hashes
    from ledger.core.keys import generate_private_key
    from ledger.producer import (
        build_statement,
        envelope_to_json,
        output_from_result,
        sign_statement,
    )
    from workers.engine.reference import TINY_DEMO_DIR

    engine = load_engine("tiny-demo", dtype="bfloat16")
    rng = random.Random(3)
    key = generate_private_key()
    artifacts = artifact_hashes(TINY_DEMO_DIR, model_name="tiny-demo")
    requests, outputs, lines = [], [], []
    for i in range(6):
        prompt = (256, *(rng.randrange(256) for _ in range(rng.randint(8, 40))))
        sampling = {"temperature": 0.8 if i % 2 else 0.0, "seed": 100 + i, "max_tokens": 12,
                    "ignore_eos": True, "logprobs": 3}
        request = GenerationRequest(f"rec-{i}", prompt, SamplingParams.from_mapping(sampling))
        res = engine.generate([request], max_batch=1)[0]
        tokens = list(res.token_ids)
        if request.id == ALTERED:
            tokens[4] = (tokens[4] + 1) % 256
        output = output_from_result(tokens, res.finish_reason, res.logprobs,
                                    res.top_logprobs, res.logits_sha256)
        st = build_statement(request_id=request.id, artifacts=artifacts,
                             prompt_token_ids=prompt, sampling=sampling,
                             runtime=engine.runtime(), output=output)
        lines.append(json.dumps(envelope_to_json(sign_statement(st, key))))
        requests.append(request)
        outputs.append({"token_ids": tokens})
    path = tmp_path / "envelopes.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path, requests, outputs


def test_matrix_run_reports_invariant_cells_and_default_kernel_divergence(
        tmp_path: Path) -> None:
    path, requests, outputs = _record(tmp_path)
    report_path = tmp_path / "report.json"
    cells = ["alone", "batch:4", "arrivals:2", "chunk:5", "prefix:warm",
             "kernels:default+chunk:16"]
    result = CliRunner().invoke(app, [
        "matrix", "run", "--envelopes", str(path), "--no-verify", "--dtype", "bfloat16",
        "--sample", "0",
        "--output", str(report_path), *[a for c in cells for a in ("--cell", c)]])
    assert result.exit_code == 0, result.output
    assert "Replay matrix" in result.output
    rep = json.loads(report_path.read_text())
    assert (tmp_path / "report.html").read_text().count("<svg") == 1
    by_cell = {c["cell"]: c for c in rep["cells"]}
    assert list(by_cell) == cells
    for name in cells[:-1]:                     # invariant cells: only the altered record
        cell = by_cell[name]
        assert cell["token_identical"] == 5 and cell["bitwise"] == 5, (name, cell)
        assert cell["first_divergence_histogram"] == {"4": 1}, (name, cell)
        (div,) = rep["divergences"][name]
        assert div["request_id"] == ALTERED and div["first_divergence"] == 4
        assert div["top_before"]["recorded"] == div["top_before"]["replayed"][:3]
    default = by_cell["kernels:default+chunk:16"]
    assert default["bitwise"] < 5, "default kernels reproduced every record bitwise"
    assert default["max_abs_logprob_diff"] > 0
    # The positions it reports are the ones a default-mode run of that cell really has.
    engine = load_engine("tiny-demo", dtype="bfloat16", batch_invariant=False)
    results, _ = _replay(engine, _requests_for(requests), parse_cell("kernels:default+chunk:16"))
    expected = {r.id: first_divergence(o["token_ids"], r.token_ids)
                for r, o in zip(results, outputs, strict=True)}
    reported = {d["request_id"]: d["first_divergence"]
                for d in rep["divergences"]["kernels:default+chunk:16"]}
    assert reported == {k: v for k, v in expected.items() if v is not None}


def _requests_for(requests: list[GenerationRequest]) -> list[GenerationRequest]:
    from workers.engine.matrix import Record

    return _requests([Record(r.id, r.prompt_token_ids, r.sampling, {}) for r in requests])


def test_compare_reports_first_divergence_and_top_k() -> None:
    recorded = {"token_ids": [5, 6, 7, 8], "logprobs": [-0.5, -1.0, -0.25, -2.0],
                "logits_sha256": ["a", "b", "c", "d"],
                "top_logprobs": [[(5, -0.5)], [(6, -1.0)], [(7, -0.25)], [(8, -2.0)]]}
    replay = Replayed(token_ids=[5, 6, 9, 8], logprobs=[-0.5, -1.5, -0.3, -2.0],
                      top_logprobs=[[(5, -0.5)], [(6, -1.5)], [(9, -0.3)], [(8, -2.0)]],
                      logits_sha256=["a", "x", "y", "d"])
    c = compare("r", recorded, replay)
    assert (c.first_divergence, c.expected_token, c.replayed_token) == (2, 7, 9)
    assert c.max_abs_logprob_diff == 0.5 and c.max_rel_logprob_diff == 0.5
    assert c.top_before == {"recorded": [[6, -1.0]], "replayed": [[6, -1.5]]}
    assert c.top_at == {"recorded": [[7, -0.25]], "replayed": [[9, -0.3]]}
    assert not c.bitwise and not c.digests_identical


def test_bad_cell_is_a_user_error(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["matrix", "run", "--envelopes", str(tmp_path / "x"),
                                      "--cell", "batch:zero"])
    assert result.exit_code == 2
