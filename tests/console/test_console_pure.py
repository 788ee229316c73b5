"""The console's pure parts: the tiny-demo tokenizer file, the diff steps, the charts."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from ledger.console import charts, queries, tokenizers

#: Published in docs/console.md: what `ledger demo` names in artifacts.tokenizer_sha256.
TINY_DEMO_TOKENIZER_SHA256 = "d60131a2598b3527e917c36e0c5f97eabf97687a87cdfdd353386ad39f476a1b"


def test_tiny_demo_tokenizer_is_stable_and_matches_the_byte_tokenizer() -> None:
    from workers.serve.tokenizer import ByteTokenizer

    assert tokenizers.TINY_DEMO_TOKENIZER_SHA256 == TINY_DEMO_TOKENIZER_SHA256
    tok = tokenizers._load(tokenizers.tiny_demo_tokenizer_json())
    byte_tok = ByteTokenizer()
    for text in ("Summarise the refund policy.", "Ünïcödé ✓ <b>&amp;</b>", "a\nb\tc"):
        ids = byte_tok.encode(text)  # <bos> + UTF-8 bytes
        pieces = tokenizers.decode(tok, ids)
        assert [p.token_id for p in pieces] == ids
        assert "".join(p.text for p in pieces) == "<bos>" + byte_tok.decode(ids)
        assert tok.encode(text, add_special_tokens=False).ids == ids[1:]
    assert tokenizers.token_text(tok, 0xD3) == "<0xD3>"  # a lone byte, not U+FFFD
    assert tokenizers.token_text(tok, 257) == "<eos>"


def test_diff_steps_for_new_and_old_verdicts() -> None:
    expected = {"token_ids": [1, 2, 3], "logprobs": [-0.1, -0.2, -0.3]}
    replayed = {"token_ids": [1, 2, 4, 5], "logprobs": [-0.1, -0.25, -0.3, -0.4]}
    steps = queries.diff_steps(expected, replayed)
    assert [s.same for s in steps] == [True, True, False, False]
    assert steps[1].logprob_diff is not None and abs(steps[1].logprob_diff + 0.05) < 1e-12
    assert steps[3].expected is None and steps[3].logprob_diff is None
    old = queries.diff_steps(expected, {})  # a verdict from before replays were recorded
    assert [s.replayed for s in old] == [None, None, None]


def test_charts() -> None:
    flat = charts.step_diffs([0.0, 0.0, 0.0])
    assert "identical bit for bit" in flat.title
    bars = charts.step_diffs([0.0, 0.5, None, 1.0], highlight=3)
    assert len(bars.bars) == 3 and bars.bars[-1].css == "k"
    assert bars.bars[-1].h > bars.bars[-2].h > bars.bars[0].h
    t = datetime(2026, 12, 1, tzinfo=UTC)
    line = charts.drift_over_time([(t + timedelta(hours=1), 0.5), (t, 0.0)])
    assert [d.value for d in line.dots] == ["0.0%", "50.0%"]  # oldest first
    assert line.dots[0].y > line.dots[1].y  # higher drift is drawn higher
    top = charts.topk_bars([("a", -0.1, True), ("b", -3.0, False)])
    assert top.bars[0].w > top.bars[1].w and top.bars[0].css == "chosen"
