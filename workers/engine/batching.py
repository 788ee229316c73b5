"""Continuous batching for the reference engine: requests join and leave at every step.

One :meth:`ContinuousBatcher.step` does, in order:

1. **admit** waiting requests (arrival order) into free cache slots, up to ``max_batch``
   running; a prefix-cache hit (``prefix_cache``) copies the cached KV of the prompt's
   leading full blocks into the slot, so only the rest is prefilled;
2. **prefill** the next chunk (``prefill_chunk`` tokens, or the whole rest) of every
   request still in its prompt, packed into forwards of at most ``prefill_token_budget``
   tokens; a request whose prompt is now complete gets its first logits from it;
3. **decode** one token for every request that has one to feed (slots 0..B-1 as one
   batch; on CUDA a CUDA graph over a power-of-two bucket); rows of requests still in
   their prompt ride along as dummies (token 0 at a spare cache position) and are dropped;
4. **sample** every request that got logits this step, record logprobs, top logprobs and
   the logits digest (hashed off the critical path), and retire finished requests (the
   last live slots move into the holes, so slots 0..B-1 stay the running requests).

**Mixed steps** (``mixed=True``; ``ReferenceEngine.mixed_steps``, off by default): a step
with prompt work runs the running requests' decode tokens inside its (first) prompt forward,
each a one-token piece at its position in its own slot, instead of a decode step and then
the prompt forward: one pass over the weights fewer. Like a decode step it is launched
without a sync; steps without prompt work keep the decode step (graph, fast launch). Prompts
admitted while a decode step is already launched wait for the next step's forward.

In batch-invariant mode a request's tokens, logprobs and logits digests do not depend on
any of this: every kernel is row-wise, and prompt attention reads the slot's cache with the
decode kernel (``ops.chunk_attention``; on CUDA ``ops.rows_attention``), so neither the
co-tenants, nor the step at which the request joined, nor the chunk size, nor a prefix-cache
hit, nor a decode token run in a prompt forward changes a bit
(``tests/engine/test_continuous.py``). The default mode gives no such promise.

``static=True`` admits a new group only when the batch is empty: ``ReferenceEngine.generate``
uses it to keep "``max_batch`` requests at a time, in file order" (the caller controls the
co-tenants, which matters for the default mode).
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from workers.engine import ops
from workers.engine.api import GenerationRequest, GenerationResult, TokenListener
from workers.engine.digests import CpuDigester, CudaDigester, hashing_threads
from workers.engine.sampling import BatchSampler

if TYPE_CHECKING:
    from workers.engine.reference import ReferenceEngine

__all__ = ["ContinuousBatcher", "Finished"]


class _StepDigests:
    """The digests of one sampling step's rows (futures of row chunks, in row order)."""

    def __init__(self, futures: list[Future[list[str]]]) -> None:
        self.futures = futures
        self._rows: list[str] | None = None

    def done(self) -> bool:
        return all(f.done() for f in self.futures)

    def row(self, i: int) -> str:
        if self._rows is None:
            self._rows = [d for f in self.futures for d in f.result()]
        return self._rows[i]


@dataclass
class _Sequence:
    ticket: int
    request: GenerationRequest
    budget: int
    result: GenerationResult
    arrived_step: int
    stops: frozenset[int] = frozenset()    # tokens that end it (its stop ids, EOS unless ignored)
    prefilled: int = 0                     # prompt tokens in the cache
    next_token: int | None = None          # to feed at the next decode step
    digests: list[tuple[_StepDigests, int]] = field(default_factory=list)
    first_token_s: float | None = None     # perf_counter when the first token was known
    token_times: list[float] = field(default_factory=list)   # perf_counter per token
    on_token: TokenListener | None = None
    aborted: bool = False                  # leaves at its next token ("abort")

    @property
    def prompt(self) -> tuple[int, ...]:
        return self.request.prompt_token_ids

    @property
    def position(self) -> int:
        """Cache position of ``next_token``."""
        return len(self.prompt) + len(self.result.token_ids) - 1


@dataclass(frozen=True)
class Finished:
    ticket: int
    result: GenerationResult
    first_token_s: float | None            # perf_counter of the first token (TTFT)
    token_times: tuple[float, ...] = ()    # perf_counter when each token was known


class ContinuousBatcher:
    """A running batch on one engine. ``add`` requests, call ``step`` until ``idle``.

    Not thread safe: one thread adds and steps (``workers.serve.batcher`` does that).
    """

    def __init__(
        self, engine: ReferenceEngine, *, max_batch: int, prefill_chunk: int | None = None,
        static: bool = False, mixed: bool = False,
    ) -> None:
        if max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        if prefill_chunk is not None and prefill_chunk < 1:
            raise ValueError("prefill_chunk must be >= 1 (or None: whole prompts)")
        self.engine = engine
        self.max_batch = max_batch
        self.prefill_chunk = prefill_chunk
        self.static = static
        self.mixed = mixed
        self.steps = 0
        self._tickets = 0
        self._waiting: deque[_Sequence] = deque()
        self._active: list[_Sequence] = []          # _active[s] lives in cache slot s
        self._retiring: list[_Sequence] = []        # finished, digests still hashing
        self._done: list[Finished] = []
        # A decode step already run for the next step: (logits [B, V], decoding slots,
        # the logits row of each of those slots: the slot itself unless slots moved since).
        self._launched: tuple[Tensor, list[int], list[int]] | None = None
        # Its inputs on the device (tokens, positions [B]); when every running request was
        # in it, the next step's feed is the sampled tokens at positions + 1 (no host copy).
        self._feed: tuple[Tensor, Tensor] | None = None
        self._prompting = 0            # running requests with prompt tokens left to prefill
        self._want_top = 0             # running requests that want top logprobs
        self._eos = frozenset(engine.config.eos_token_ids)
        self._sampler = BatchSampler([], [], engine.config.vocab_size, engine.device)
        self._exit = contextlib.ExitStack()
        threads = hashing_threads(engine.device)
        pool = self._exit.enter_context(
            ThreadPoolExecutor(max_workers=threads, thread_name_prefix="logits-sha256"))
        self._digester: CpuDigester | CudaDigester
        if engine.device.type == "cuda":
            self._digester = CudaDigester(engine._digest_ring_for_device(), pool, threads)
        else:
            self._digester = CpuDigester(pool)

    # ------------------------------------------------------------------ public
    def add(self, request: GenerationRequest, on_token: TokenListener | None = None) -> int:
        """Queue a request (validated now: ``ValueError``); returns its ticket. ``on_token``
        hears each of its tokens the step it is sampled (a stream's source)."""
        budget = self.engine._budget(request)
        ticket = self._tickets
        self._tickets += 1
        seq = _Sequence(ticket, request, budget, GenerationResult(
            id=request.id, token_ids=[], finish_reason="length", logprobs=[],
            top_logprobs=[] if request.sampling.logprobs else None, logits_sha256=[]),
            arrived_step=self.steps,
            stops=frozenset(request.sampling.stop_token_ids)
            | (frozenset() if request.sampling.ignore_eos else self._eos), on_token=on_token)
        if budget == 0:
            self._done.append(Finished(ticket, seq.result, None))
        else:
            self._waiting.append(seq)
        return ticket

    def abort(self, ticket: int) -> bool:
        """Stop a request (its client went away): a waiting one finishes now with no
        tokens, a running one at its next sampled token (in a step the batch runs anyway);
        either way its result, finish reason "abort", comes out of :meth:`take_finished`.
        False (nothing done) for an unknown or finished ticket."""
        for seq in self._waiting:
            if seq.ticket == ticket:
                self._waiting.remove(seq)
                seq.result.finish_reason = "abort"
                self._done.append(Finished(ticket, seq.result, None))
                return True
        for seq in self._active:
            if seq.ticket == ticket and not seq.aborted:
                seq.aborted = True
                return True
        return False

    @property
    def idle(self) -> bool:
        return not (self._waiting or self._active or self._retiring)

    @property
    def running(self) -> int:
        return len(self._active)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def take_finished(self) -> list[Finished]:
        """Results finished since the last call (digests complete)."""
        self._deliver(block=not (self._waiting or self._active))
        done, self._done = self._done, []
        return done

    def step(self) -> None:
        """One engine step (admit, prefill chunks, one decode token; see the module doc)."""
        engine = self.engine
        with torch.inference_mode(), ops.batch_invariant_mode(engine.batch_invariant):
            self._admit()
            if self._active:
                self._step()
        self.steps += 1

    def run(self) -> list[Finished]:
        """Step until every added request finished; all results, in ticket order."""
        finished: list[Finished] = []
        while not self.idle:
            if self._waiting or self._active:
                self.step()
            finished += self.take_finished()
        finished += self.take_finished()
        return sorted(finished, key=lambda f: f.ticket)

    def close(self) -> None:
        self._deliver(block=True)
        self._exit.close()

    def __enter__(self) -> ContinuousBatcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ the step
    def _admit(self) -> None:
        if self.static and self._active:
            return
        engine = self.engine
        mode = engine.prefix_mode()
        room = self.max_batch - len(self._active)
        if not self._waiting or room <= 0:
            return
        group = list(self._waiting)[:room]
        if self._launched is not None:     # the cache (and its graphs' buffers) may be
            logits, decoding, logit_rows = self._launched     # replaced below: own a copy
            self._launched = (logits.clone(), decoding, logit_rows)
        # Slots for the whole batch at once (static: this group), so the cache (and on
        # CUDA its graph set) is not regrown one slot at a time.
        engine._ensure_cache(len(group) if self.static else self.max_batch,
                             max(len(s.prompt) + s.budget for s in group))
        for _ in group:
            seq = self._waiting.popleft()
            slot = len(self._active)
            cache = engine._ensure_cache(slot + 1, len(seq.prompt) + seq.budget)
            # A new occupant may find a former one's k/v past its own positions: harmless,
            # attention reads only positions < its own length, each written before read.
            if engine.prefix_cache is not None:
                pages = engine.prefix_cache.lookup(seq.prompt, mode)
                engine.prefix_cache.load(cache, slot, pages)
                seq.prefilled = len(pages) * engine.prefix_cache.block_size
                engine.stats.prefix_hit_tokens += seq.prefilled
            self._active.append(seq)
            self._prompting += seq.prefilled < len(seq.prompt)
            self._want_top += seq.result.top_logprobs is not None
            self._sampler.add(seq.request.sampling, seq.prompt)
            engine.stats.prompt_tokens += len(seq.prompt)

    def _prefill(self, decoding: Sequence[int] = ()
                 ) -> tuple[Tensor | None, list[tuple[int, Tensor]]]:
        """Run this step's prompt chunks: (slot, fp32 logits [V]) of completed prompts. With
        ``decoding`` (a mixed step) the first forward also carries each of those slots' next
        token, first, as a one-token piece at its position, and takes at most
        ``engine.mixed_step_tokens`` rows in all (at least one prompt token): their fp32
        logits [len(decoding), V] come back too (else None), and nothing waits for the
        device."""
        if not self._prompting:
            return None, []
        engine = self.engine
        cache = engine._cache
        assert cache is not None
        budget = engine.prefill_token_budget
        # A mixed step's one forward: its decode tokens, then prompt tokens up to
        # ``mixed_step_tokens`` in all (the rest waits for the next step; chunk boundaries
        # change no bit), so that it replays as a captured prompt graph.
        room = max(1, engine.mixed_step_tokens - len(decoding)) if decoding else None
        pieces: list[tuple[int, int, int]] = []            # (slot, first position, length)
        for slot, seq in enumerate(self._active):
            left = len(seq.prompt) - seq.prefilled
            if left <= 0:
                continue
            n = left if self.prefill_chunk is None else min(left, self.prefill_chunk)
            if room is not None:
                if room <= 0:
                    break
                n = min(n, room)
                room -= n
            for start in range(seq.prefilled, seq.prefilled + n, budget):
                pieces.append((slot, start, min(budget, seq.prefilled + n - start)))
        if not pieces:
            return None, []
        began = time.perf_counter()
        n_dec = len(decoding)
        groups: list[list[tuple[int, int, int]]] = [
            [(slot, self._active[slot].position, 1) for slot in decoding]]
        used = 0
        for piece in pieces:
            if groups[-1] and used + piece[2] > budget:
                groups.append([])
                used = 0
            groups[-1].append(piece)
            used += piece[2]
        dev = engine.device
        ready: list[tuple[int, Tensor]] = []
        decoded: Tensor | None = None
        for g, group in enumerate(groups):
            ahead = n_dec if g == 0 else 0        # the group's leading decode pieces
            # Inputs built on the host and sent in one copy that does not wait for the
            # device, the chunk table from the same host values: the prefill's launches
            # queue behind the decode step still running (no sync before the forward).
            chunks, packed, bounds = [], 0, [0]
            tokens_l: list[int] = []
            positions_l: list[int] = []
            slots_l: list[int] = []
            for i, (slot, p0, n) in enumerate(group):
                chunks.append((slot, packed, n, p0))
                packed += n
                bounds.append(packed)
                seq = self._active[slot]
                if i < ahead:
                    assert seq.next_token is not None
                    tokens_l.append(seq.next_token)
                else:
                    tokens_l += seq.prompt[p0:p0 + n]
                positions_l += range(p0, p0 + n)
                slots_l += [slot] * n
            inputs = torch.tensor(tokens_l + positions_l + slots_l + bounds,
                                  dtype=torch.int64).to(dev, non_blocking=True)
            tokens, positions, slots = inputs[:3 * packed].view(3, packed)
            cu = inputs[3 * packed:].to(torch.int32)
            logits = engine._prefill(cache, tokens, positions, slots, cu, chunks)  # [C, V]
            if ahead:
                decoded = logits[:ahead]
            for row, (slot, p0, n) in enumerate(group[ahead:], start=ahead):
                seq = self._active[slot]
                seq.prefilled = p0 + n
                engine.stats.prefill_tokens += n
                if seq.prefilled == len(seq.prompt):
                    self._prompting -= 1
                    ready.append((slot, logits[row]))
                    if engine.prefix_cache is not None:
                        engine.prefix_cache.store(cache, slot, seq.prompt,
                                                  engine.prefix_mode())
        if decoded is None:             # a mixed forward stays asynchronous, like a decode step
            engine._synchronize()
        engine.stats.prefill_s += time.perf_counter() - began
        return decoded, ready

    def _step(self) -> None:
        engine = self.engine
        stats = engine.stats
        if not (self.mixed and self._prompting):
            ready = self._prefill()[1]
        elif self._launched is None:    # a mixed step: the decode tokens ride in the prompt's
            decoding = [s for s, seq in enumerate(self._active) if seq.next_token is not None]
            decoded, ready = self._prefill(decoding)
            if decoded is not None:
                self._launched = (decoded, decoding, list(range(len(decoding))))
                self._feed = None
                stats.decode_steps += 1
                stats.mixed_steps += 1
        else:                           # a decode step was launched before these prompts
            ready = []                  # came: they ride in the next step's forward
        decode_began = time.perf_counter()
        dev = engine.device
        if self._launched is None:
            self._launch_decode()
        launched, self._launched = self._launched, None
        feed, self._feed = self._feed, None
        rows: list[int] = []
        parts: list[Tensor] = []
        if launched is not None:
            logits, decoding, logit_rows = launched
            rows += decoding
            parts.append(logits if logit_rows == list(range(logits.shape[0])) else
                         logits[torch.tensor(logit_rows).to(dev, non_blocking=True)])
        if ready:
            rows += [slot for slot, _ in ready]
            parts.append(torch.stack([row for _, row in ready]))
        if not rows:
            return
        # Every running request decoded in the launched step and none joined it: row r is
        # slot r, the sampler's rows are all in order and the next feed stays on the device.
        whole = not ready and len(rows) == len(self._active)
        logits = parts[0] if len(parts) == 1 else torch.cat(parts)            # [R, V]
        seqs = [self._active[s] for s in rows]
        steps = [len(seq.result.token_ids) for seq in seqs]
        sampler_rows = None if whole else rows
        chosen = self._sampler.choose(logits, steps, sampler_rows)            # [R]
        logprobs = ops.log_softmax(logits)                                    # fp32 [R, V]
        chosen_lp = logprobs.gather(1, chosen[:, None])[:, 0]
        staged = self._digester.stage(logits)                         # see digests.py
        top = self._top_logprobs(seqs, logprobs) if self._want_top else None
        self._sampler.record(chosen, sampler_rows)
        # The step's one device->host sync: token ids and logprob bits together.
        both = torch.stack([chosen, chosen_lp.view(torch.int32).to(torch.int64)])
        # (not when every row ends now anyway: its budget spent, or aborted)
        fast = whole and feed is not None and not all(
            n + 1 >= seq.budget or seq.aborted for seq, n in zip(seqs, steps, strict=True))
        if fast:
            # Launch the next step before the sync (async scheduling, as vLLM's): every
            # running request, fed from the device (the sampled tokens at the next
            # positions), so the device goes from this step's sampling straight into the
            # next forward while the host waits for the tokens and does the bookkeeping
            # below. A request that finishes now rides along in it once; its row is
            # dropped (``_ahead_retire``), and its one extra k/v write lands at a
            # position it never reads (< its prompt + budget, inside its slot).
            assert feed is not None
            host = both.to("cpu", non_blocking=True)              # pinned: really async
            copied = engine._event()
            self._launch(list(range(len(self._active))), chosen, feed[1] + 1)
            if copied is not None:
                copied.synchronize()
        else:
            host = both.cpu()
        token_ids = host[0].tolist()
        token_lps = host[1].to(torch.int32).view(torch.float32).tolist()
        now = time.perf_counter()

        finished = [slot for slot, seq, token, n in zip(rows, seqs, token_ids, steps,
                                                        strict=True)
                    if token in seq.stops or n + 1 >= seq.budget or seq.aborted]
        if fast and finished:
            self._ahead_retire(finished)
        digests = _StepDigests(self._digester.start(staged))   # type: ignore[arg-type]
        stats.generated_tokens += len(rows)
        for r, (seq, token, lp) in enumerate(zip(seqs, token_ids, token_lps, strict=True)):
            result = seq.result
            result.token_ids.append(token)
            result.logprobs.append(lp)
            if top is not None and result.top_logprobs is not None:
                result.top_logprobs.append(top[r])
            seq.digests.append((digests, r))
            if seq.first_token_s is None:
                seq.first_token_s = now
            seq.token_times.append(now)
            last = True
            if seq.aborted:
                result.finish_reason = "abort"
            elif token in seq.stops:
                result.finish_reason = "stop"
            elif len(result.token_ids) >= seq.budget:
                result.finish_reason = "length"
            else:
                seq.next_token, last = token, False
            if seq.on_token is not None:
                seq.on_token(token, lp, top[r] if result.top_logprobs is not None and top
                             is not None else None, result.finish_reason if last else None)
        if not fast:
            if finished:
                self._retire(finished)
            # The next step's decode goes to the device now, so the host work until then
            # (the next step's admission and prefill bookkeeping, this step's digests)
            # overlaps it; with prompt work left in a mixed batch, the next step's prompt
            # forward carries it instead.
            if not (self.mixed and self._prompting):
                self._launch_decode()
        if finished:
            self._deliver(block=False)
        stats.decode_s += time.perf_counter() - decode_began

    def _launch_decode(self) -> None:
        """Run (on CUDA: enqueue) one decode step for every request with a token to feed;
        kept in ``_launched`` for the step that samples it. Slots 0..B-1 as one batch; rows
        still in their prompt are dummies (token 0 at a spare position), dropped later."""
        decoding = [s for s, seq in enumerate(self._active) if seq.next_token is not None]
        if not decoding:
            self._launched = None
            return
        cache = self.engine._cache
        assert cache is not None
        spare = cache.max_seq - 1                            # never a live position
        feed = [seq.next_token if seq.next_token is not None else 0 for seq in self._active]
        feed += [seq.position if seq.next_token is not None else spare
                 for seq in self._active]
        both = torch.tensor(feed).to(self.engine.device, non_blocking=True)   # one copy
        b = len(self._active)
        self._launch(decoding, both[:b], both[b:])

    def _launch(self, decoding: list[int], tokens: Tensor, positions: Tensor) -> None:
        engine = self.engine
        cache = engine._cache
        assert cache is not None
        logits = engine._decode(cache, tokens, positions)                    # [B, V]
        self._launched = (logits, decoding, decoding)
        self._feed = (tokens, positions)
        engine.stats.decode_steps += 1

    def _top_logprobs(self, seqs: list[_Sequence], logprobs: Tensor
                      ) -> list[list[tuple[int, float]]]:
        from workers.engine.reference import top_logprobs

        wanted = [(r, int(seq.request.sampling.logprobs or 0))
                  for r, seq in enumerate(seqs) if seq.request.sampling.logprobs]
        out: list[list[tuple[int, float]]] = [[] for _ in seqs]
        if not wanted:
            return out
        k_max = min(max(k for _, k in wanted), logprobs.shape[-1])
        ids, values = top_logprobs(
            logprobs[torch.tensor([r for r, _ in wanted], device=logprobs.device)], k_max)
        for (r, k), row_ids, row_values in zip(wanted, ids.tolist(), values.tolist(),
                                              strict=True):
            out[r] = list(zip(row_ids[:k], row_values[:k], strict=True))
        return out

    def _ahead_retire(self, finished: list[int]) -> None:
        """Retire ``finished`` after the next step was launched with every running row:
        that step's logits and feed are in the old slot order, so keep the rows of the
        requests that stay, in their new slot order (the slot moves are queued after the
        launched step, so it wrote the movers' k/v where the moves copy it from)."""
        kept = self._retire(finished)
        assert self._launched is not None and self._feed is not None
        if not kept:
            self._launched = self._feed = None
            return
        logits, _, _ = self._launched
        tokens, positions = self._feed
        index = torch.tensor(kept).to(self.engine.device, non_blocking=True)
        self._launched = (logits, list(range(len(kept))), kept)
        self._feed = (tokens[index], positions[index])

    def _retire(self, finished: list[int]) -> list[int]:
        """Remove finished slots; the last live slots move into the holes. Returns rows:
        new slot s holds the request that was in slot rows[s]. The caller delivers."""
        cache = self.engine._cache
        assert cache is not None
        gone = set(finished)
        keep = [s for s in range(len(self._active)) if s not in gone]
        n = len(keep)
        holes = [s for s in range(n) if s in gone]
        movers = [s for s in keep if s >= n]
        order = dict(zip(holes, movers, strict=True))
        for dst, src in order.items():
            cache.move_slot(src, dst)
        rows = [order.get(s, s) for s in range(n)]
        self._retiring += [self._active[s] for s in finished]
        self._want_top -= sum(self._active[s].result.top_logprobs is not None
                              for s in finished)
        self._active = [self._active[r] for r in rows]
        self._sampler.compact(rows)
        return rows

    def _deliver(self, *, block: bool) -> None:
        """Move retired sequences whose digests are all hashed to the finished list."""
        waited = time.perf_counter()
        still: list[_Sequence] = []
        for seq in self._retiring:
            if block or all(d.done() for d, _ in seq.digests):
                seq.result.logits_sha256 = [d.row(i) for d, i in seq.digests]
                self._done.append(Finished(seq.ticket, seq.result, seq.first_token_s,
                                           tuple(seq.token_times)))
            else:
                still.append(seq)
        self._retiring = still
        if block:
            self.engine.stats.digest_wait_s += time.perf_counter() - waited


def run_requests(engine: ReferenceEngine, requests: Sequence[GenerationRequest], *,
                 max_batch: int, prefill_chunk: int | None = None,
                 static: bool = False) -> list[GenerationResult]:
    """All requests through one batcher; results in request order."""
    with ContinuousBatcher(engine, max_batch=max_batch, prefill_chunk=prefill_chunk,
                           static=static) as batcher:
        for request in requests:
            batcher.add(request)
        return [f.result for f in batcher.run()]
