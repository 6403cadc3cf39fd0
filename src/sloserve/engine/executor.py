"""The real executor: runs a ``SchedulerOutput`` through the model, same interface as ``SimExecutor``.

Per step: the swaps the scheduler decided (swap-outs first, then swap-ins: a step that preempts
swaps nothing in; then BROS's slot copies, in order), one forward pass over the flat tokens of every
chunk and cohort member, and a sample for every request whose known tokens are all computed. A
request finishes on EOS (unless ``ignore_eos``), at ``max_tokens``, or when it is scheduled after it
was aborted (``Request.aborted``: nothing of it is computed). A recompute-evicted request is refilled
from its token list (prompt + generated), so nothing is lost. With async scheduling a step may be
launched before the step before's tokens are on the host (``async_scheduling.py``): a request ended by
such a token finishes with the next step (its token there dropped), or, uncomputed, with the first one
that schedules it after.
"""

from __future__ import annotations

import collections.abc
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from sloserve.core.outputs import SchedulerOutput, StepResult
from sloserve.core.request import Request
from sloserve.cost.base import BatchShape, batch_shape
from sloserve.engine.async_scheduling import SampledOnDevice, index_tensor, to_device
from sloserve.engine.attention import AttentionMetadata, PrefillSeq
from sloserve.engine.cuda_graphs import DecodeGraphs
from sloserve.engine.device_idle import DeviceIdleTime
from sloserve.engine.kv_cache import KVCacheTensor, expand_block_ids
from sloserve.engine.loader import LoadedModel
from sloserve.engine.logprobs import Logprobs, PendingLogprobs, logprobs_on_device
from sloserve.engine.penalties import PenaltyCounts
from sloserve.engine.piecewise_graphs import PiecewiseGraphs, piecewise_graphs_for
from sloserve.engine.sampler import PROMPT_LOGITS_ROWS, SamplingParams, apply_controls, sample_on_device
from sloserve.engine.state_cache import StateMetadata, StateSlots
from sloserve.engine.structured_output import GrammarMatchers, accept
from sloserve.kv.manager import KVCacheManager


@dataclass
class Sequence:
    """The engine's side of a request: its tokens and how to sample them."""

    token_ids: list[int]  # prompt + generated so far
    num_prompt_tokens: int
    params: SamplingParams
    generator: np.random.Generator | None  # the request's own draws (host side: see sampler.sample)
    finish_reason: str | None = None  # "stop" (EOS), "length" (max_tokens), as in OpenAI's API, or "abort"
    stop_reason: int | None = None  # the stop token id it ended on (vLLM's; the tokenizer's EOS: None)
    # Where params ask for them: each output token's log-probabilities, and each prompt token's after
    # the first (prompt position p at index p - 1), as far as computed
    logprobs: list[Logprobs] | None = None
    prompt_logprobs: list[Logprobs] | None = None
    matcher: Any = None  # the grammar's matcher (structured_output.py), with params.grammar
    # With async scheduling: when its last token reached the host, on the engine's clock (NaN: never late)
    last_token_back: float = math.nan

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]


@dataclass
class StepInputs:
    """A step's flat inputs, as ``EngineExecutor.execute`` builds them from a ``SchedulerOutput``: every token
    the step processes, in the order of its chunks and then its cohort's members, and where each request's
    tokens sit among them."""

    tokens: list[int] = field(default_factory=list)  # (T,) 0 where the token is still on the device (``late``)
    positions: list[int] = field(default_factory=list)  # (T,)
    prefills: list[PrefillSeq] = field(default_factory=list)  # the chunks of several tokens, their context tables
    prefill_slots: list[tuple[int, np.ndarray]] = field(default_factory=list)  # (flat index, slots written to)
    decodes: list[tuple[int, Request]] = field(default_factory=list)  # (flat index, request) of one-token rows
    samplers: list[tuple[Request, int]] = field(default_factory=list)  # (request, flat index of its last token)
    scored: list[tuple[Sequence, int, int]] = field(default_factory=list)  # (sequence, flat index, position predicted)
    # Scheduled, but ended (their client went away, or a token brought back late ended them): finished, not computed
    skipped: list[Request] = field(default_factory=list)
    late: list[tuple[int, int]] = field(default_factory=list)  # (flat index, row of the step before's tokens)
    # (flat index, tokens, state slot, goes on): ``StateMetadata.prefills``
    state_prefills: list[tuple[int, int, int, bool]] = field(default_factory=list)
    state_saves: dict[int, tuple[int, int]] = field(default_factory=dict)  # (``StateMetadata.saves``)
    # (slot, entry's slot): states saved as the forward pass leaves them
    saved_after: list[tuple[int, int]] = field(default_factory=list)


class EngineExecutor:
    """Runs steps on a real model. ``kv`` is the scheduler's KV manager: it says where tokens live.
    With ``graphs``, a decode-only step that fits them replays a CUDA graph (``cuda_graphs``); with
    ``piecewise``, another step that fits them replays its pieces around eager attention
    (``piecewise_graphs``).

    ``step_log``: None, or a list that gets (shape, measured seconds) of every step, the shape as the
    simulator's cost model sees it: the run's own steps, to check a fitted cost model against
    (``sloserve run --out`` writes them as ``steps.csv``, a profile CSV). A step launched early on a GPU
    (``async_scheduling``) spends its host time beside the step before's device time, so its entry
    gets its own time on the device once its tokens are back (CUDA events from its first device work
    to its sampling: with the GPU busy, its kernels' time; waiting on the host, that wait too).

    ``during_forward``: None, or host work to overlap with the device's forward pass (the served
    engine publishes the previous step's tokens there): called once in every step that runs one,
    after it is launched and before anything waits for it. ``during_forward_exposed_s`` is how much
    of its time that step waited for: all of it on the CPU (where the forward pass has run by then),
    none on a GPU that was still computing when it ended.

    ``async_scheduling``: a step may launch before the step before's tokens are on the host
    (``async_scheduling.py``): they come back during its forward pass (``in_flight`` until then), and
    ``during_forward`` runs after them, in every step launched early (one with no tokens too).

    ``device_idle``: on CUDA, the seconds the device waited for the host between steps (``device_idle.py``).
    """

    def __init__(
        self,
        model: nn.Module,
        kv: KVCacheManager,
        cache: KVCacheTensor,
        device: torch.device,
        eos_token_ids: tuple[int, ...] = (),
        seed: int = 0,
        graphs: DecodeGraphs | None = None,
        piecewise: PiecewiseGraphs | None = None,
        tokenizer_eos_token_id: int | None = None,
        states: StateSlots | None = None,
    ) -> None:
        self.model, self.kv, self.cache, self.device = model, kv, cache, device
        self.states = states  # (a model with state layers: each request's slot of their states)
        self.graphs, self.piecewise = graphs, piecewise
        self.eos_token_ids = frozenset(eos_token_ids)  # every id that ends a generation (not ignore_eos)
        # NOTE: the one of them whose end is reported with stop_reason None (vLLM's: the tokenizer's EOS;
        # the generation config's others are stop token ids to it, reported as such)
        self.tokenizer_eos_token_id = tokenizer_eos_token_id
        self.sequences: dict[Request, Sequence] = {}
        self.penalties = PenaltyCounts(device)  # the token counts of the requests with penalties
        self._seed = seed
        self.num_forward_tokens = 0
        self.step_log: list[tuple[BatchShape, float]] | None = None
        self.during_forward: Callable[[], None] | None = None
        self.during_forward_exposed_s = 0.0
        # The grammars' matchers, over the model's tokenizer (set by the engine for the first request with one)
        self.grammar_matchers: GrammarMatchers | None = None
        self.async_scheduling = False
        self.num_early_launches = 0  # steps launched before the step before's tokens were on the host
        self.in_flight: SampledOnDevice | None = None  # the last step's tokens, still on the device
        # Requests a token brought back late ended, that the scheduler has not heard of yet: they end
        # (uncomputed, as an aborted request) in the next step that schedules them
        self._stopped: set[Request] = set()
        self._clock_offset = 0.0  # the engine's clock less time.perf_counter(), as of the last step
        # The in-flight step's entry of ``step_log`` and its device time's start and end events (CUDA)
        self._timed: tuple[int, torch.cuda.Event, torch.cuda.Event] | None = None
        self.device_idle = DeviceIdleTime(device)  # (the GPU's waits for the host between steps)

    @classmethod
    def for_model(
        cls,
        loaded: LoadedModel,
        kv: KVCacheManager,
        cache: KVCacheTensor,
        max_context: int,
        eos_token_ids: tuple[int, ...] = (),
        seed: int = 0,
        states: StateSlots | None = None,
    ) -> EngineExecutor:
        """An executor of ``loaded``'s model with the CUDA graphs it was loaded for (``cuda_graphs``): the
        decode graphs, their slot tables ``max_context`` wide, and the piecewise graphs where they are
        switched on."""
        # (OPT has no rotary embedding: learned positions; Gemma 3's sliding layers have one of their own)
        for rotary in (getattr(loaded.model, "rotary", None), getattr(loaded.model, "local_rotary", None)):
            if rotary is not None:
                rotary.serve_context(max_context)  # NOTE: before the graphs capture its tables
                # NOTE: built now, not in the first step: its copy of the frequencies to the GPU would wait for the
                # device in a step launched early (async scheduling)
                rotary.tables(cache.gpu.device)  # (the device the steps' positions are on: cuda:0, not cuda)
        graphs = None
        if loaded.cuda_graphs:
            graphs = DecodeGraphs(
                loaded.model, cache, max_context, kv.table_block_size, states=None if states is None else states.cache
            )
        piecewise = piecewise_graphs_for(loaded.model, cache, loaded.cuda_graphs)
        eos = getattr(loaded.tokenizer, "eos_token_id", None)
        return cls(loaded.model, kv, cache, loaded.device, eos_token_ids, seed, graphs, piecewise, eos, states)

    def add(self, request: Request, prompt_token_ids: list[int], params: SamplingParams) -> None:
        generator = None
        if not params.greedy:
            # NOTE: without a seed, each request still gets its own stream (engine seed + request id),
            # so a run is deterministic and independent of batching.
            seed = params.seed if params.seed is not None else self._seed * 1_000_003 + request.request_id
            # NOTE: OpenAI's seeds are int64, numpy's non-negative: a negative one wraps to its unsigned
            # 64-bit twin (every int64 seed stays a stream of its own)
            generator = np.random.default_rng(seed % 2**64 if seed < 0 else seed)
        self.sequences[request] = Sequence(
            list(prompt_token_ids),
            len(prompt_token_ids),
            params,
            generator,
            logprobs=None if params.logprobs is None else [],
            prompt_logprobs=None if params.prompt_logprobs is None else [],
            matcher=None if params.grammar is None else self.grammar_matchers.matcher(params.grammar),
        )

    def remove(self, request: Request) -> Sequence | None:
        """Forget ``request``: its sequence (returned; None if it had none) and its penalty counts."""
        self.penalties.release(request)
        return self.sequences.pop(request, None)

    @torch.inference_mode()
    def execute(
        self, output: SchedulerOutput, now: float, end_times: collections.abc.Sequence[float] | None = None
    ) -> StepResult:
        """Run ``output`` (one step) starting at ``now``; the step ends ``now`` + its measured time
        (``end_times``, the simulator's precomputed ones, are not used). With ``async_scheduling``, a
        step that can is launched before the step before's tokens are on the host: it ends when the host
        has them (its device work may go on), and its own tokens come back with the next step."""
        assert output.num_steps == 1, "the engine runs steps one at a time (fast_path=False)"
        shape = batch_shape(output) if self.step_log is not None else None  # before the step moves requests on
        t0 = time.perf_counter()
        self._clock_offset = now - t0
        pipelined = self.async_scheduling and self._launches_early(output)
        if not pipelined:
            self.resolve()  # this step's inputs or samples need the step before's tokens on the host
        before = self.in_flight  # None unless pipelined
        started = timed = None  # on a GPU, where a step launched early with a step log starts its device work
        if pipelined and shape is not None and self.device.type == "cuda":
            started = torch.cuda.Event(enable_timing=True)
            started.record()
        self.cache.swap_out(output.swap_out)
        self.cache.swap_in(output.swap_in)
        self.cache.copy_slots(output.slot_copies)
        if self.states is not None:  # (a request holds its states' slot while it holds KV blocks)
            self.states.keep_only(self.kv.block_tables)
        inputs = StepInputs()
        self._add_chunks(inputs, output.chunks, before)
        if output.decode is not None:
            cohort = output.decode.cohort
            cohort.settle_all()  # the KV growth reserved for the members by count gets its block ids now
            self._add_cohort(cohort.members, inputs)
        samplers, late = inputs.samplers, inputs.late
        self.during_forward_exposed_s = 0.0
        seqs = [self.sequences[r] for r, _ in samplers]
        launched, ended_early = None, None
        if inputs.tokens:
            self.device_idle.forward_launched()
            # NOTE: built before the forward pass: a copy to the device after its launch waits for it
            rows = index_tensor([i for _, i in samplers], self.device)  # (N,)
            late_tokens = None
            if late:  # (P,) flat indices, (P,) the tokens there: gathered on the device
                source = before.device_ids[index_tensor([row for _, row in late], self.device)]
                late_tokens = (index_tensor([i for i, _ in late], self.device), source)
            hidden = self._forward(inputs, late_tokens)
            for slot, entry in inputs.saved_after:
                self.states.cache.copy(slot, entry)
            if self.during_forward is not None and not pipelined:
                self._overlap(self.during_forward)
            logits = self.model.compute_logits(hidden[rows]).float()  # (N, vocab)
            params = [s.params for s in seqs]
            if pipelined and before is not None and any(s.matcher is not None for s in seqs):
                # A grammar's matcher takes the step before's tokens before it masks this step's scores:
                # they are waited for now, while this step's forward pass runs (vLLM v1 fills its grammar
                # bitmasks so too), and are then all on the host.
                ended_early = self.resolve()
                late = []  # (for the score controls: no row's last token is still on the device)
            scores = self._controlled(logits, samplers, lambda: self._late_rows(samplers, late, late_tokens))
            sampled = sample_on_device(scores, params, [s.generator for s in seqs])  # (N,)
            logprobs = self._logprobs_on_device(logits, seqs, sampled)
            prompt_logprobs = self._prompt_logprobs_on_device(hidden, inputs.scored)
            sampled_at = self.device_idle.step_ended()  # (on CUDA: an event after the sampling)
            if pipelined:  # NOTE: all of it comes back with the tokens (``resolve``)
                if started is not None:
                    timed = (len(self.step_log), started, sampled_at)  # (this step's entry is the next one)
                launched = SampledOnDevice(sampled, [r for r, _ in samplers], logprobs, prompt_logprobs)
                self.num_early_launches += before is not None
            else:
                sampled = sampled.tolist()
                _append_prompt_logprobs(prompt_logprobs)
        ended_before = self._end_skipped(inputs.skipped)
        if pipelined:
            finished, ended_in_flight = self._finish_early(samplers, seqs, ended_early)
            ended_before += ended_in_flight
            self.in_flight, self._timed = launched, timed
            if self.during_forward is not None:  # NOTE: after the step before's tokens came back
                self._overlap(self.during_forward)
        else:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            by_row = _logprobs_by_row(logprobs, sampled) if inputs.tokens else None
            finished = self._accept([r for r, _ in samplers], sampled if inputs.tokens else [], logprobs=by_row)
        elapsed = time.perf_counter() - t0
        self.num_forward_tokens += len(inputs.tokens)
        if shape is not None:
            self.step_log.append((shape, elapsed))
        return StepResult(step_end_times=(now + elapsed,), finished=finished, ended_before=ended_before)

    def _add_chunks(
        self, inputs: StepInputs, chunks: list[tuple[Request, int]], before: SampledOnDevice | None
    ) -> None:
        """``_add_chunk`` for each of ``chunks``, in order; each run of decodes among them (a policy that names
        every request it runs, BROS's) a list at a time, as the decode cohort's (``_add_cohort``): the same
        inputs. NOTE: a decode here processes one token past its prompt and samples (a model with states
        keeps each request's own, chunk by chunk)."""
        decodes: list[Request] = []
        for request, num_tokens in chunks:
            if (
                num_tokens == 1
                and not request.is_prefill
                and request.num_computed_tokens >= request.num_prompt_tokens
                and self.states is None
            ):
                decodes.append(request)
                continue
            if decodes:
                self._add_cohort(decodes, inputs)
                decodes = []
            self._add_chunk(inputs, request, num_tokens, before)
        if decodes:
            self._add_cohort(decodes, inputs)

    def _add_chunk(self, inputs: StepInputs, request: Request, num_tokens: int, before: SampledOnDevice | None) -> None:
        """Add ``request``'s next ``num_tokens`` tokens to the step's ``inputs`` (``before``: the step before's
        tokens, where they are still on the device)."""
        seq = self.sequences[request]
        start = request.num_computed_tokens
        end = start + num_tokens
        if request.aborted or request in self._stopped:
            # NOTE: its slots were allocated for this step and are left unwritten; the scheduler
            # frees them when it sees the request finished, as after an EOS.
            inputs.skipped.append(request)
            return
        flat = len(inputs.tokens)
        known = seq.token_ids[start:end]
        inputs.tokens.extend(known)
        if len(known) < num_tokens:  # NOTE: a decode's token (``_launches_early``), sampled by ``before``
            inputs.late.append((flat, before.rows[request]))
            inputs.tokens.append(0)
        inputs.positions.extend(range(start, end))
        if self.states is not None:
            cache, saved = self.states.cache, self.kv.cached_states
            first = request not in self.states.of
            slot = self.states.slot(request)
            if first and start > 0:  # (admitted past a cached prefix: from the states saved at its end)
                cache.copy(cache.entry_slot(saved.loads.pop(request)), slot)
            if num_tokens > 1:
                inputs.state_prefills.append((flat, num_tokens, slot, start > 0))
            elif start == 0:  # (a one-token prompt runs as a decode: from zero states)
                cache.clear(slot)
            pending = None if saved is None else saved.pending.get(request)
            if pending is not None and start < pending[1] <= end:  # (the chunk reaches its saved point)
                k, entry = pending[1] - start, cache.entry_slot(pending[2])
                if k < num_tokens:
                    inputs.state_saves[flat] = (k, entry)
                else:
                    inputs.saved_after.append((slot, entry))
        if num_tokens == 1:
            inputs.decodes.append((flat, request))
        else:
            context = self.kv.slot_table(request, end)
            inputs.prefills.append(PrefillSeq(flat, num_tokens, to_device(torch.from_numpy(context), self.device)))
            inputs.prefill_slots.append((flat, context[start:]))
        if end == request.num_tokens:
            inputs.samplers.append((request, flat + num_tokens - 1))
        if seq.prompt_logprobs is not None:
            # NOTE: position q's hidden state predicts token q + 1; positions scored before (a
            # refill after a recompute preemption) are not scored again. The step before's scores may
            # still be on their way (async scheduling): this chunk then starts past them, and a
            # preempted request's refill comes steps later.
            first = max(start + 1, len(seq.prompt_logprobs) + 1)
            for position in range(first, min(end, seq.num_prompt_tokens - 1) + 1):
                inputs.scored.append((seq, flat + position - 1 - start, position))

    def _launches_early(self, output: SchedulerOutput) -> bool:
        """Whether ``output`` may be launched before the step before's tokens are on the host."""
        before = self.in_flight
        # NOTE: a chunk of several tokens that needs the token still on the device (a refill) waits for it
        return before is None or not any(n > 1 and r in before.rows for r, n in output.chunks)

    def _finish_early(
        self,
        samplers: list[tuple[Request, int]],
        seqs: list[Sequence],
        ended_early: list[Request] | None = None,
    ) -> tuple[list[Request], list[Request]]:
        """A step launched early: the step before's tokens back on the host (``ended_early``: the
        requests they ended, when they came back before this step sampled). Returns the requests whose
        token of this step is their ``max_tokens``-th, by count (that token comes back with the next
        step), and those the step before's tokens ended that this step ran (the token it gave them is
        dropped; those it did not run end when a step schedules them)."""
        ended = set(self.resolve() if ended_early is None else ended_early)
        finished, ran_ended = [], []
        for (request, _), seq in zip(samplers, seqs, strict=True):
            if request in ended:
                self._stopped.discard(request)
                ran_ended.append(request)
            elif seq.finish_reason is None and len(seq.token_ids) + 1 - seq.num_prompt_tokens >= seq.params.max_tokens:
                finished.append(request)
        return finished, ran_ended

    def _end_skipped(self, skipped: list[Request]) -> list[Request]:
        """The scheduled requests that ended before this step ran them: aborted, or ended by a token that
        came back late (``_stopped``), now finished."""
        for request in skipped:
            self._stopped.discard(request)
            seq = self.sequences[request]
            if seq.finish_reason is None:
                seq.finish_reason = "abort"
        return list(skipped)

    def take_step_log(self) -> list[tuple[BatchShape, float]]:
        """The entries of ``step_log`` whose times are final, removed from it: all but a step still in flight
        on a GPU, whose time comes back with its tokens (``resolve``)."""
        if not self.step_log:
            return []
        num_final = len(self.step_log) if self._timed is None else self._timed[0]
        taken, self.step_log[:num_final] = self.step_log[:num_final], []
        if self._timed is not None:  # NOTE: its entry moved up by the entries taken
            entry, started, sampled_at = self._timed
            self._timed = (entry - num_final, started, sampled_at)
        return taken

    def resolve(self) -> list[Request]:
        """Bring the last step's tokens to the host if they are still on the device (async scheduling):
        append them and return the requests they ended that the scheduler has not finished; those end
        in the next step that schedules them (``_stopped``)."""
        before, self.in_flight = self.in_flight, None
        timed, self._timed = self._timed, None
        if before is None:
            return []
        tokens = before.token_ids()
        if timed is not None:  # (its sampling is done: the tokens were copied after it)
            entry, started, sampled_at = timed
            self.step_log[entry] = (self.step_log[entry][0], started.elapsed_time(sampled_at) / 1e3)
        _append_prompt_logprobs(before.prompt_logprobs)
        by_row = _logprobs_by_row(before.logprobs, tokens)
        ended = self._accept(
            list(before.rows), tokens, back_at=time.perf_counter() + self._clock_offset, logprobs=by_row
        )
        self._stopped.update(ended)
        return ended

    def _accept(
        self,
        requests: list[Request],
        tokens: list[int],
        back_at: float | None = None,
        logprobs: list[Logprobs | None] | None = None,
    ) -> list[Request]:
        """Append each request's sampled token (and its ``logprobs``, where it has them); return the
        requests it ended (EOS, a stop token, the grammar's end, ``max_tokens``) that the scheduler has
        not finished. ``back_at``: when the tokens reached the host (async scheduling), a request's
        first token time from then on; the last one's is kept (``LLMEngine.take_finished`` gives it to
        the request; None: the policy's is right).

        NOTE: the scheduler timed the tokens when their step returned, before they existed on a GPU."""
        ended = []
        for row, (request, token) in enumerate(zip(requests, tokens, strict=True)):
            seq = self.sequences.get(request)
            if seq is None or seq.finish_reason is not None or request.aborted:
                # NOTE: it ended before this token (a step launched before its end was known); it may
                # be released already. A request aborted while its token was on the device had that
                # token counted by its step's update: the count drops it too.
                if request.aborted and not request.is_finished:
                    request.drop_output_token()
                continue
            seq.token_ids.append(token)
            if logprobs is not None and logprobs[row] is not None:
                seq.logprobs.append(logprobs[row])
            # NOTE: also when None: a token taken at its step's end has the policy's time
            seq.last_token_back = math.nan if back_at is None else back_at
            if back_at is not None and len(seq.token_ids) == seq.num_prompt_tokens + 1:
                request.first_token_time = back_at
            if seq.params.ends_on(token, self.eos_token_ids):
                eos = token == self.tokenizer_eos_token_id and not seq.params.ignore_eos
                seq.finish_reason, seq.stop_reason = "stop", None if eos else token
            elif seq.matcher is not None and accept(seq.matcher, token):
                seq.finish_reason = "stop"  # the grammar is complete
            elif len(seq.token_ids) - seq.num_prompt_tokens >= seq.params.max_tokens:
                seq.finish_reason = "length"
            if seq.finish_reason is not None and not request.is_finished:
                ended.append(request)
        return ended

    def _add_cohort(self, members: collections.abc.Collection[Request], inputs: StepInputs) -> None:
        """``_add_chunk(inputs, request, 1)`` for each of ``members`` (the decode cohort's, or a run of decodes
        a policy named), a list at a time.

        NOTE: a member processes one token, its last known one (num_tokens_to_process is 1), and
        samples; its prompt is done, so it has no prompt position to score."""
        tokens, late = inputs.tokens, inputs.late
        running = [r for r in members if not r.aborted and r not in self._stopped]
        if len(running) < len(members):
            inputs.skipped.extend(r for r in members if r.aborted or r in self._stopped)
        sequences = self.sequences
        starts = [r.num_computed_tokens for r in running]
        flat = range(len(tokens), len(tokens) + len(running))
        if self.in_flight is None:
            tokens.extend([sequences[r].token_ids[start] for r, start in zip(running, starts)])
        else:  # the members that sampled in the step before take their token from the device
            rows = self.in_flight.rows
            for i, r, start in zip(flat, running, starts):
                row = rows.get(r)
                if row is None:
                    tokens.append(sequences[r].token_ids[start])
                else:
                    late.append((i, row))
                    tokens.append(0)
        inputs.positions.extend(starts)
        inputs.decodes.extend(zip(flat, running))
        inputs.samplers.extend(zip(running, flat))

    def _overlap(self, host_work: Callable[[], None]) -> None:
        """Run ``host_work`` while the forward pass just launched computes; keep the part of its time
        the step waits for (``during_forward_exposed_s``)."""
        launched = None
        if self.device.type == "cuda":
            launched = torch.cuda.Event()
            launched.record()
        start = time.perf_counter()
        host_work()
        # NOTE: a forward pass still computing when the work ends hid all of it; one that was done
        # may have hidden part of it, counted as none (the host's share is not underestimated)
        hidden = launched is not None and not launched.query()
        self.during_forward_exposed_s = 0.0 if hidden else time.perf_counter() - start

    @staticmethod
    def _late_rows(
        samplers: list[tuple[Request, int]],
        late: list[tuple[int, int]],
        late_tokens: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> tuple[list[int], torch.Tensor] | None:
        """The sampling rows whose last token is still on the device, and those tokens (a decode
        samples at its own flat index), for the score controls; None when there are none."""
        if not late:
            return None
        at = {flat: k for k, (flat, _) in enumerate(late)}  # flat index -> its entry of ``late``
        rows = [row for row, (_, flat) in enumerate(samplers) if flat in at]
        return rows, late_tokens[1][index_tensor([at[samplers[row][1]] for row in rows], late_tokens[1].device)]

    def _controlled(
        self,
        logits: torch.Tensor,  # (N, vocab) the raw scores of the rows that sample
        samplers: list[tuple[Request, int]],  # (N,) the request of each row (and its flat index)
        late_rows: Callable[[], tuple[list[int], torch.Tensor] | None] = lambda: None,
    ) -> torch.Tensor:  # (N, vocab)
        """The scores each row samples from: its params' controls applied (to a copy: logprobs report
        the raw scores). ``late_rows``: the rows whose last token is still on the device, and those
        tokens (``_late_rows``), found only if a row has controls."""
        requests = [r for r, _ in samplers]
        seqs = [self.sequences[r] for r in requests]
        params = [s.params for s in seqs]
        guided = [i for i, s in enumerate(seqs) if s.matcher is not None]
        if not guided and not any(p.controls_scores for p in params):
            return logits
        scores = logits.clone()
        token_ids = [s.token_ids for s in seqs]
        num_prompt_tokens = [s.num_prompt_tokens for s in seqs]
        late = late_rows()
        apply_controls(scores, params, token_ids, num_prompt_tokens, self.eos_token_ids, late)
        self.penalties.apply(scores, requests, params, token_ids, num_prompt_tokens, late)
        if guided:  # NOTE: last, so that no other control can bring back a token the grammar forbids
            self.grammar_matchers.mask(scores, guided, [seqs[i].matcher for i in guided])
        return scores

    @staticmethod
    def _logprobs_on_device(
        logits: torch.Tensor,  # (N, vocab) of the rows just sampled
        seqs: list[Sequence],
        sampled: torch.Tensor,  # (N,) the tokens sampled, on the device
    ) -> PendingLogprobs | None:
        """The sampled tokens' log-probabilities of the rows that ask for them (None if none does)."""
        rows = [i for i, s in enumerate(seqs) if s.logprobs is not None]
        if not rows:
            return None
        index = index_tensor(rows, logits.device)
        num_top = [seqs[i].params.logprobs for i in rows]
        return PendingLogprobs(rows, num_top, logprobs_on_device(logits[index], sampled[index], max(num_top)))

    def _prompt_logprobs_on_device(
        self,
        hidden: torch.Tensor,  # (T, H) the step's final hidden states
        scored: list[tuple[Sequence, int, int]],  # (sequence, flat index, prompt position it predicts)
    ) -> list[PendingLogprobs]:
        """The log-probabilities of the prompt positions ``scored`` names, ``PROMPT_LOGITS_ROWS`` at a time."""
        parts = []
        for at in range(0, len(scored), PROMPT_LOGITS_ROWS):
            part = scored[at : at + PROMPT_LOGITS_ROWS]
            logits = self.model.compute_logits(hidden[index_tensor([flat for _, flat, _ in part], self.device)])
            targets = [seq.token_ids[position] for seq, _, position in part]
            num_top = [seq.params.prompt_logprobs for seq, _, _ in part]
            found = logprobs_on_device(logits.float(), index_tensor(targets, self.device), max(num_top))
            parts.append(PendingLogprobs([seq for seq, _, _ in part], num_top, found, targets))
        return parts

    def _forward(
        self,
        inputs: StepInputs,
        late_tokens: tuple[torch.Tensor, torch.Tensor] | None = None,  # (P,) flat indices, (P,) their tokens
    ) -> torch.Tensor:  # (T, H)
        """The model's forward pass over the step's flat tokens: a graph replay for a decode-only step
        that fits the captured graphs, else the piecewise graphs' replays for a step that fits them,
        else eager. ``late_tokens``: the tokens at those flat indices, on the device (async scheduling:
        ``inputs.tokens`` holds 0 there)."""
        tokens, positions, prefills, decodes = inputs.tokens, inputs.positions, inputs.prefills, inputs.decodes
        # NOTE: the decodes' context tables are built at once, as block ids (a batch of hundreds of
        # long contexts is a block size smaller that way); the device expands them to slots.
        g = self.kv.table_block_size
        lengths = np.array([positions[i] + 1 for i, _ in decodes], dtype=np.int64)  # (B,) each decode's context
        if decodes:
            block_ids = self.kv.block_id_tables([r for _, r in decodes], lengths)  # (B, >= max context / g)
            last = lengths - 1
            written = block_ids[np.arange(len(decodes)), last // g] * g + last % g  # (B,) slot of each new token
        else:
            block_ids, written = np.zeros((0, 1), dtype=np.int64), lengths
        if not prefills and self.graphs is not None and self.graphs.fits(len(decodes), int(lengths.max(initial=0))):
            # NOTE: with no prefill, decode i is flat token i (each decode adds one token, in order).
            slots = None if self.states is None else [self.states.of[r] for _, r in decodes]
            return self.graphs.forward(tokens, positions, lengths, written, block_ids, late_tokens, slots)
        if self.piecewise is not None and self.piecewise.fits(len(tokens)):
            # NOTE: the metadata covers the padding rows, whose K/V go to the pad slot
            size = self.piecewise.size_for(len(tokens))
            meta = self._metadata(size, inputs, lengths, written, block_ids)
            return self.piecewise.forward(tokens, positions, meta, late_tokens)
        meta = self._metadata(len(tokens), inputs, lengths, written, block_ids)
        if self.states is not None:
            slots = index_tensor([self.states.of[r] for _, r in decodes], self.device)  # (B,)
            meta.states = StateMetadata(
                inputs.state_prefills, meta.decode_token_index, slots, self.states.cache, inputs.state_saves
            )
        ids = index_tensor(tokens, self.device)  # (T,)
        if late_tokens is not None:
            ids[late_tokens[0]] = late_tokens[1]
        pos = index_tensor(positions, self.device)  # (T,)
        return self.model(ids, pos, self.cache.gpu, meta)

    def _metadata(
        self,
        num_tokens: int,  # (the step's tokens and its padding rows)
        inputs: StepInputs,
        lengths: np.ndarray,  # (B,) each decode's context tokens
        written: np.ndarray,  # (B,) slot of each decode's new token
        block_ids: np.ndarray,  # (B, >= max context / g) their block_id_tables
    ) -> AttentionMetadata:
        device = self.device
        slot_mapping = np.full(num_tokens, self.cache.pad_slot, dtype=np.int64)  # (T,) padding rows: the pad slot
        for flat, slots in inputs.prefill_slots:
            slot_mapping[flat : flat + len(slots)] = slots
        flat_index = np.array([i for i, _ in inputs.decodes], dtype=np.int64)  # (B,)
        slot_mapping[flat_index] = written
        return AttentionMetadata(
            slot_mapping=to_device(torch.from_numpy(slot_mapping), device),
            prefills=inputs.prefills,
            decode_token_index=to_device(torch.from_numpy(flat_index), device),
            decode_slots=expand_block_ids(to_device(torch.from_numpy(block_ids), device), self.kv.table_block_size),
            decode_context_lens=to_device(torch.from_numpy(lengths), device),
        )


def _append_prompt_logprobs(parts: list[PendingLogprobs]) -> None:
    """Append the prompt positions' log-probabilities to their sequences, in order."""
    for part in parts:
        for seq, found in zip(part.rows, part.to_host(), strict=True):
            seq.prompt_logprobs.append(found)


def _logprobs_by_row(pending: PendingLogprobs | None, tokens: list[int]) -> list[Logprobs | None] | None:
    """The sampled tokens' log-probabilities row by row (None for a row without), or None if no row has them."""
    if pending is None:
        return None
    by_row: list[Logprobs | None] = [None] * len(tokens)
    for row, found in zip(pending.rows, pending.to_host([tokens[row] for row in pending.rows]), strict=True):
        by_row[row] = found
    return by_row
