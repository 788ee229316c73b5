"""``ledger engine serve``'s engine in a process of its own (workers/serve/engine_process.py):
the same answers as the engine batched in this process, streams told token by token,
aborts, refusals, and a child that dies failing its waiters instead of hanging them."""

from __future__ import annotations

import functools
import threading
from typing import Any

import pytest

from workers.engine.api import GenerationRequest, SamplingParams
from workers.serve.engine_process import EngineError, EngineProcess, load_reference

LOADER = functools.partial(load_reference, "tiny-demo", "cpu", "float32", True, 1, 0)


def _requests() -> list[GenerationRequest]:
    return [GenerationRequest(f"r{i}", tuple(range(3 * i, 3 * i + 5 + i)),
                              SamplingParams(max_tokens=6 + i, temperature=0.7 * (i % 2),
                                             seed=i, logprobs=i % 3, ignore_eos=True))
            for i in range(6)]


@pytest.fixture(scope="module")
def process() -> Any:
    engine = EngineProcess(LOADER, max_batch=4)
    yield engine
    engine.close()


def test_answers_and_streams_are_the_in_process_engines(process: EngineProcess) -> None:
    from workers.engine import load_engine

    local = load_engine("tiny-demo", threads=1)
    assert process.runtime() == local.runtime()
    assert process.config.vocab_size == local.config.vocab_size
    want = [local.generate([r], max_batch=1)[0] for r in _requests()]
    heard: dict[int, list[tuple[Any, ...]]] = {i: [] for i in range(6)}
    futures = [process.submit(r, on_token=lambda *t, i=i: heard[i].append(t))
               for i, r in enumerate(_requests())]
    got = [f.result(timeout=120) for f in futures]
    assert got == want                       # tokens, logprobs, top logprobs, digests
    for i, result in enumerate(got):
        assert [h[0] for h in heard[i]] == result.token_ids
        assert [h[3] for h in heard[i]][-1] == result.finish_reason


def test_abort_refusal_and_a_dead_child(process: EngineProcess) -> None:
    started = threading.Event()
    long = GenerationRequest("long", (1, 2, 3), SamplingParams(max_tokens=900,
                                                               ignore_eos=True))
    future = process.submit(long, on_token=lambda *_: started.set())
    assert started.wait(60)
    process.abort(future)
    result = future.result(timeout=60)
    assert result.finish_reason == "abort" and len(result.token_ids) < 900
    assert process.aborts >= 1

    outside = GenerationRequest("x", (1, 99999), SamplingParams(max_tokens=5))
    with pytest.raises(ValueError, match="token id outside"):
        process.submit(outside).result(timeout=60)

    engine = EngineProcess(LOADER, max_batch=2)
    try:
        started.clear()
        future = engine.submit(long, on_token=lambda *_: started.set())
        assert started.wait(60)
        engine._process.kill()
        with pytest.raises(EngineError, match="exited"):
            future.result(timeout=60)
        with pytest.raises(EngineError):
            engine.submit(long).result(timeout=60)
    finally:
        engine.close()


def test_a_model_that_does_not_load_is_an_engine_error(tmp_path: Any) -> None:
    loader = functools.partial(load_reference, str(tmp_path / "none"), "cpu", "float32",
                               True, 1, 0)
    with pytest.raises(EngineError, match="none"):
        EngineProcess(loader)
