"""The engine: a registered scheduler driving a real model through ``EngineExecutor``.

The step loop is the simulator's (``sloserve.replica.Replica``: schedule, execute, update) with the
engine's executor in place of the cost model, so the same timeline and metrics come out.
"""

from __future__ import annotations

import dataclasses
import gc
import heapq
import math
import os
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any

import numpy as np
import torch

from sloserve.checkpoint.model_config import ModelConfig
from sloserve.core.errors import ConfigError
from sloserve.core.prefix import TokenPrompt, salted_root_key
from sloserve.core.request import Request
from sloserve.cost import LinearCostModel, get_preset, linear_coefficients
from sloserve.cost.base import CostModel
from sloserve.cost.specs import STATE_SLOTS
from sloserve.engine.executor import EngineExecutor
from sloserve.engine.executor import Sequence as SequenceState
from sloserve.engine.kv_cache import KVCacheTensor
from sloserve.engine.loader import LoadedModel
from sloserve.engine.sampler import SamplingParams
from sloserve.engine.state_cache import StateCache, StateSlots
from sloserve.engine.structured_output import GrammarMatchers
from sloserve.engine.switches import switch
from sloserve.engine.tokenizer import HFTokenizer
from sloserve.replica import Replica
from sloserve.sched import make_scheduler, supports_prefix_caching
from sloserve.sched.registry import saved_state_entries, state_slots
from sloserve.workload.closed_loop import ClosedLoopBatches

# Default KV cache on the CPU: this many bytes, at most 64 full contexts (vLLM's CPU backend takes a
# fixed KV space too). On CUDA: this fraction of the memory free after loading the weights, or of what is
# left of this process's share where ``torch.cuda.set_per_process_memory_fraction`` capped it (engines
# sharing one GPU; the tests' workers do).
CPU_KV_CACHE_BYTES = 1 << 30
CPU_KV_CACHE_CONTEXTS = 64
GPU_MEMORY_UTILIZATION = 0.9
# A model with state layers (Mamba-2's, short convolutions') keeps states for at most this many requests at once
# (fewer where its scheduler's max_num_seqs says: ``registry.state_slots``; on the CPU, as many as its default KV
# cache holds contexts)
MAX_STATE_SLOTS = {"cuda": STATE_SLOTS, "cpu": CPU_KV_CACHE_CONTEXTS}
# Default swap space: as large as the KV cache, at most 4 GiB (vLLM's default swap_space).
MAX_SWAP_BYTES = 4 << 30


def kv_bytes_per_token(loaded: LoadedModel) -> int:
    """K and V of one token over all layers at the model's dtype (MLA's keys alone: they are its values)."""
    c = loaded.config
    return c.kv_cache_tensors * c.num_kv_layers * c.kv_cache_heads * c.kv_cache_head_dim * loaded.dtype.itemsize


def resolve_max_model_len(config: ModelConfig, max_model_len: int | None) -> int:
    """The context the engine serves: ``max_model_len``, or the model's positions when not given.
    Beyond the model's positions is refused, as vLLM does (the rotary or learned positions end there), but for a model
    of no attention (Mamba's: its recurrence alone orders its tokens, however many)."""
    if max_model_len is None:
        return config.max_position_embeddings
    if max_model_len < 2:
        raise ConfigError(f"max_model_len must be >= 2, got {max_model_len}")
    if max_model_len > config.max_position_embeddings and config.num_kv_layers:
        raise ConfigError(
            f"max_model_len {max_model_len} is above the model's context of {config.max_position_embeddings} "
            "tokens (max_position_embeddings in its config)"
        )
    return max_model_len


def free_cuda_bytes(loaded: LoadedModel) -> int:
    """Bytes free on ``loaded``'s GPU, within what is left of this process's share of it."""
    device = loaded.device if loaded.device.index is not None else torch.device("cuda", torch.cuda.current_device())
    gc.collect()  # engines gone but not yet collected (a cycle holds them) let go of their KV caches
    torch.cuda.empty_cache()  # and the blocks cached from them are free again
    free, total = torch.cuda.mem_get_info(device)
    share = torch.cuda.get_per_process_memory_fraction(device) * total  # (an index, not "cuda", is taken)
    return int(max(min(free, share - torch.cuda.memory_reserved(device)), 0))


def host_memory_bytes() -> int | None:
    """The host's physical memory, or None where the OS does not say (``os.sysconf``)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):
        return None


def default_kv_capacity(
    loaded: LoadedModel, max_model_len: int, reserved_bytes: int = 0, num_state_slots: int = 0
) -> int:
    """KV capacity in tokens when none is given (see the constants above); on CUDA, of the memory left beside
    ``reserved_bytes`` (the requests' states of a model with state layers). A model of no attention (Mamba's: 0
    bytes a token): the tokens of ``num_state_slots`` whole contexts (default: as many as it keeps states for)."""
    bytes_per_token = kv_bytes_per_token(loaded)
    if not bytes_per_token:
        return (num_state_slots or MAX_STATE_SLOTS.get(loaded.device.type, STATE_SLOTS)) * max_model_len
    if loaded.device.type == "cuda":
        return int((free_cuda_bytes(loaded) * GPU_MEMORY_UTILIZATION - reserved_bytes) // bytes_per_token)
    return min(CPU_KV_CACHE_BYTES // bytes_per_token, CPU_KV_CACHE_CONTEXTS * max_model_len)


def check_kv_fits(
    loaded: LoadedModel, capacity: int, swap_tokens: int, bytes_per_token: int, state_bytes: int = 0
) -> None:
    """A ConfigError when a KV cache of ``capacity`` tokens (and ``state_bytes`` of its requests' states, beside
    it) does not fit in the device's memory, or they and ``swap_tokens`` of swap space (always on the host) do not
    fit in the host's: a cache asked for by size is refused here rather than killed by the OS (or by CUDA) as it
    is filled in."""

    def gib(num_bytes: int) -> str:  # (in MiB below one GiB: a state cache's may be small)
        return f"{num_bytes / 2**30:,.1f} GiB" if num_bytes >= 2**30 else f"{num_bytes / 2**20:,.1f} MiB"

    states = f" and {gib(state_bytes)} of the requests' states" if state_bytes else ""
    host_bytes = swap_tokens * bytes_per_token
    if loaded.device.type == "cuda":
        free = free_cuda_bytes(loaded)
        if capacity * bytes_per_token + state_bytes > free:
            remedy = (  # (a model of no attention: its tokens take no memory, its requests' states do)
                f"give at most {max(free - state_bytes, 0) // bytes_per_token:,}"
                if bytes_per_token
                else "keep fewer requests' states (the scheduler's max_num_seqs)"
            )
            raise ConfigError(
                f"kv_capacity_tokens {capacity:,} needs {gib(capacity * bytes_per_token)} of KV cache "
                f"({bytes_per_token:,} bytes a token){states} but {loaded.device} has {gib(free)} free after the "
                f"weights; {remedy}"
            )
    else:
        host_bytes += capacity * bytes_per_token + state_bytes
    host = host_memory_bytes()
    if host is not None and host_bytes > host:
        raise ConfigError(
            f"kv_capacity_tokens {capacity:,} and {swap_tokens:,} tokens of swap space{states} need "
            f"{gib(host_bytes)} of the host's memory ({bytes_per_token:,} bytes a token); it has {gib(host)}"
        )


def default_async_scheduling(loaded: LoadedModel) -> bool:
    """Whether an engine of ``loaded`` schedules asynchronously unless told (``async_scheduling.py``): on
    CUDA unless SLOSERVE_ASYNC_SCHEDULING=0 (1.09-1.15x the output tokens/s on an H200, 2026-11-29). On
    the CPU the forward pass is the host's own work: there is nothing to overlap it with."""
    return switch("SLOSERVE_ASYNC_SCHEDULING", default=True) and loaded.device.type == "cuda"


def engine_cost_model(cost_model: str | CostModel | None) -> CostModel:
    """The cost model a policy that estimates batch times (BROS) uses on the engine: a preset name or
    JSON file (``sloserve profile`` fits one for this model and machine), else InferMax's
    Llama-2-7B/A100 preset."""
    if isinstance(cost_model, CostModel):
        return cost_model
    if cost_model is None:
        return LinearCostModel(get_preset("llama-2-7b-a100"))
    return LinearCostModel(linear_coefficients(cost_model))


def check_request(
    prompt_token_ids: Sequence[int],
    params: SamplingParams,
    *,
    max_model_len: int,
    vocab_size: int,
    kv_capacity_tokens: int,
    eos_token_ids: Collection[int] = (),
    where: str = "prompt",
) -> SamplingParams:
    """A ConfigError naming ``where`` for a request that cannot run; else its params with ``max_tokens``
    cut to what the context leaves, as vLLM does."""
    n = len(prompt_token_ids)
    if n < 1:
        raise ConfigError(f"{where}: empty prompt")
    if params.bad_words and params.bad_words_token_ids is None:  # NOTE: a caller's slip, not a user's
        raise ConfigError(f"{where}: bad_words are not tokenized (SamplingParams.tokenize_bad_words)")
    bad = [t for t in prompt_token_ids if not (isinstance(t, (int, np.integer)) and 0 <= t < vocab_size)]
    if bad:
        raise ConfigError(f"{where}: token id {bad[0]!r} is outside the vocabulary [0, {vocab_size})")
    if n >= max_model_len:
        raise ConfigError(
            f"{where}: {n} prompt tokens leave no room to generate within the model's context of "
            f"{max_model_len} tokens (max_model_len)"
        )
    named = [t for t in params.token_ids_named() if t >= vocab_size]
    if named:
        raise ConfigError(
            f"{where}: token id {named[0]} (logit_bias, stop_token_ids or allowed_token_ids) is outside the "
            f"vocabulary [0, {vocab_size})"
        )
    nothing_left = params.leaves_no_token(eos_token_ids)
    if nothing_left:
        raise ConfigError(f"{where}: {nothing_left}")
    params = dataclasses.replace(
        params,
        max_tokens=min(params.max_tokens, max_model_len - n),
        min_tokens=min(params.min_tokens, max_model_len - n),
    )
    peak = n + params.max_tokens - 1
    if peak > kv_capacity_tokens:
        raise ConfigError(
            f"{where}: KV capacity {kv_capacity_tokens} tokens cannot hold one request of "
            f"{n} prompt tokens + max_tokens {params.max_tokens} - 1 = {peak} tokens"
        )
    return params


class LLMEngine:
    """A model, a scheduler over a KV cache of ``kv_capacity_tokens`` slots, and the step loop.

    ``max_model_len`` caps the context (default: the model's); ``max_tokens`` of a request is cut to
    what the context leaves, as vLLM does. ``enable_prefix_caching``: share the KV blocks of common
    prefixes (``None``, the default: wherever the scheduler supports it, as vLLM v1).
    ``async_scheduling``: launch a step before the step before's tokens are on the host
    (``async_scheduling.py``; ``None``, the default: ``default_async_scheduling``).
    """

    def __init__(
        self,
        loaded: LoadedModel,
        scheduler: str = "vllm",
        *,
        kv_capacity_tokens: int | None = None,
        swap_space_tokens: int | None = None,
        max_model_len: int | None = None,
        cost_model: str | CostModel | None = None,
        seed: int = 0,
        scheduler_options: dict[str, Any] | None = None,
        enable_prefix_caching: bool | None = None,
        async_scheduling: bool | None = None,
    ) -> None:
        config = loaded.config
        self.loaded = loaded
        self.max_model_len = resolve_max_model_len(config, max_model_len)
        if enable_prefix_caching is None:  # (on wherever the scheduler supports it, as vLLM v1 turns it on by default)
            enable_prefix_caching = supports_prefix_caching(scheduler, scheduler_options)
        num_state_slots = 0  # (a model with state layers: the requests whose states it keeps at once)
        if config.has_request_states:
            most = MAX_STATE_SLOTS.get(loaded.device.type, STATE_SLOTS)
            num_state_slots = min(most, state_slots(scheduler, scheduler_options))
        # (and with prefix caching, states saved at cached prefixes' ends: kv/cached_states.py)
        num_state_entries = saved_state_entries(num_state_slots, enable_prefix_caching)
        state_bytes = (num_state_slots + num_state_entries) * StateCache.bytes_per_slot(config, loaded.dtype)
        capacity = (
            kv_capacity_tokens
            if kv_capacity_tokens is not None
            else default_kv_capacity(loaded, self.max_model_len, state_bytes, num_state_slots)
        )
        if capacity < 1 and kv_capacity_tokens is None:
            raise ConfigError(
                f"no {loaded.device} memory is left for a KV cache after the model's weights (of this process's "
                "share: torch.cuda.set_per_process_memory_fraction); pass kv_capacity_tokens"
            )
        if capacity < 1:
            raise ConfigError(f"kv_capacity_tokens must be >= 1, got {capacity}")
        bytes_per_token = kv_bytes_per_token(loaded)
        if swap_space_tokens is not None and swap_space_tokens < 0:
            raise ConfigError(f"swap_space_tokens must be >= 0, got {swap_space_tokens}")
        sized_by_caller = kv_capacity_tokens is not None or swap_space_tokens is not None
        if swap_space_tokens is None:
            # (none for a model of no attention: its tokens have no KV, and its states are not swapped)
            swap_space_tokens = min(capacity, MAX_SWAP_BYTES // bytes_per_token) if bytes_per_token else 0
        if sized_by_caller:  # NOTE: the defaults fit by construction
            check_kv_fits(loaded, capacity, swap_space_tokens, bytes_per_token, state_bytes)
        self.scheduler = make_scheduler(
            scheduler,
            kv_capacity_tokens=capacity,
            max_model_len=self.max_model_len,
            kv_bytes_per_token=bytes_per_token,
            swap_space_tokens=swap_space_tokens,
            options=scheduler_options,
            cost_model=engine_cost_model(cost_model),
            enable_prefix_caching=enable_prefix_caching,
            max_requests=num_state_slots or None,
        )
        kv = self.scheduler.kv
        states = None
        if num_state_slots:
            states = StateSlots(StateCache(config, num_state_slots, loaded.dtype, loaded.device, num_state_entries))
        self.cache = KVCacheTensor(
            config,
            kv.gpu.num_blocks * kv.block_size,
            kv.cpu.num_blocks * kv.block_size,
            kv.block_size,
            loaded.dtype,
            loaded.device,
        )
        self.executor = EngineExecutor.for_model(
            loaded, kv, self.cache, self.max_model_len, config.eos_token_ids, seed, states
        )
        self.executor.async_scheduling = (
            default_async_scheduling(loaded) if async_scheduling is None else async_scheduling
        )
        self.replica = Replica(0, self.scheduler, self.executor)
        self._next_id = 0
        self._finishing: list[Request] = []  # finished by the scheduler, a token still on the device

    # --- requests ------------------------------------------------------------------------------
    def check_request(
        self, prompt_token_ids: Sequence[int], params: SamplingParams, where: str = "prompt"
    ) -> SamplingParams:
        """Validate one request (``check_request``); returns its params with ``max_tokens`` cut to the
        context and its ``bad_words`` tokenized."""
        try:
            params = params.tokenize_bad_words(self.loaded.tokenizer)
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from None
        return check_request(
            prompt_token_ids,
            params,
            max_model_len=self.max_model_len,
            vocab_size=self.loaded.config.vocab_size,
            kv_capacity_tokens=self.scheduler.kv.capacity_tokens,
            eos_token_ids=self.executor.eos_token_ids,
            where=where,
        )

    def add_request(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        arrival_time: float = 0.0,
        request: Request | None = None,
        cache_salt: str | None = None,
    ) -> Request:
        """Queue a request (validated with ``check_request`` first). ``request`` may carry a workload's
        own request (its class, SLO and arrival); otherwise one is made. ``cache_salt`` (vLLM's): its
        prompt's blocks are shared only with requests of the same salt."""
        params = self.check_request(prompt_token_ids, params)
        if request is None:
            # NOTE: the engine cannot know the output length; the oracle predictor sees max_tokens.
            request = Request(self._next_id, arrival_time, len(prompt_token_ids), params.max_tokens, params.max_tokens)
        self._next_id = max(self._next_id, request.request_id) + 1
        self.scheduler.check_fits(request, len(prompt_token_ids) + params.max_tokens - 1)
        if params.grammar is not None:
            self.grammar_matchers()
        self.executor.add(request, list(prompt_token_ids), params)
        # Prefix caching keys the blocks by the tokens themselves (prompt, then what it generates),
        # whatever content a workload's request described. NOTE: a request that asks for its prompt's
        # logprobs computes every prompt token, so it neither finds nor leaves blocks in the cache
        # (vLLM v1 skips the cache for them too).
        scores_prompt = params.prompt_logprobs is not None
        token_ids = self.executor.sequences[request].token_ids
        request.prompt_blocks = None if scores_prompt else TokenPrompt(token_ids, salted_root_key(cache_salt))
        self.replica.add(request, arrival_time)
        return request

    def grammar_matchers(self) -> GrammarMatchers:
        """The matchers of the requests' grammars, made with the first; a ConfigError for a model without
        the tokenizer they need."""
        if self.executor.grammar_matchers is None:
            tokenizer = self.loaded.tokenizer
            if not isinstance(tokenizer, HFTokenizer):
                raise ConfigError(
                    "structured output needs the model's tokenizer (a tokenizer.json or a GGUF file's); this model "
                    "has none"
                )
            config = self.loaded.config
            self.executor.grammar_matchers = GrammarMatchers(
                tokenizer.to_json(), config.vocab_size, config.eos_token_ids
            )
        return self.executor.grammar_matchers

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self.executor.in_flight is not None or bool(self._finishing)

    def step(self, next_arrival: float = math.inf) -> list[Request]:
        """One step: schedule, run the model, update. Returns the requests that finished, with all their
        tokens (with async scheduling, a request's last token comes back a step after its end)."""
        if self.scheduler.has_unfinished():
            before = self.executor.in_flight
            # NOTE: not `self._finishing += ...`: the step's forward pass may take finished requests
            # from the list (EngineCore.flush), which would leave them in the list read before it
            finished = self.replica.step(next_arrival)
            self._finishing += finished
            if before is not None and self.executor.in_flight is before:
                self.executor.resolve()  # no step ran to bring its tokens back during
        else:
            self.executor.resolve()
        if not self.scheduler.has_unfinished():
            self.executor.device_idle.engine_idle()  # (until work comes, the device waits for the clients)
        return self.take_finished()

    def take_finished(self) -> list[Request]:
        """The finished requests not yet returned whose tokens are all on the host (``step`` returns
        them; a served engine publishes them as soon as the next step's forward pass is launched).

        NOTE: with async scheduling, a request that ended by count (``max_tokens``) waits while its last
        token is on the device, and has its finish reason once it is on the host; a row of a request that
        had ended before it (its token dropped) is not waited for."""
        in_flight, sequences = self.executor.in_flight, self.executor.sequences
        if in_flight is None or not self._finishing:
            done, self._finishing = self._finishing, []
        else:
            waiting = {r for r in self._finishing if r in in_flight.rows and sequences[r].finish_reason is None}
            done = [r for r in self._finishing if r not in waiting]
            self._finishing = [r for r in self._finishing if r in waiting]
        for request in done:
            # NOTE: its last token's time and its end are when that token reached the host (async
            # scheduling), not the policy's (when a step returned, or the step after a stop token)
            back = sequences[request].last_token_back
            if not math.isnan(back) and not request.aborted:
                request.last_token_time = request.finish_time = back
        return done

    def output_token_ids(self, request: Request, start: int = 0) -> list[int]:
        """``request``'s output tokens from its ``start``-th on (the new ones of a loop that reads them
        every step: a copy of the whole output each step would cost the step its length)."""
        seq = self.executor.sequences[request]
        return seq.token_ids[seq.num_prompt_tokens + start :]

    def abort(self, request: Request) -> None:
        """Stop ``request`` (its client went away). It finishes with ``finish_reason`` "abort" and frees
        its KV in the next step its scheduler schedules it in; nothing of it is computed from then on.

        NOTE: a running request is in the next step of every policy that runs all of its running
        requests each step (vLLM's and Sarathi's decodes); a waiting one keeps its place in the queue
        until the policy picks it, since each policy orders its own queues."""
        if not request.is_finished:
            request.aborted = True

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's ``reset_prefix_cache``): later prompts compute their blocks
        again, as on a cold engine. False, and nothing changed, while a request holds KV (one running, or one
        aborted that its scheduler has not dropped yet: its next step does)."""
        return self.scheduler.kv.reset_prefix_cache()

    def release(self, request: Request) -> SequenceState | None:
        """Forget a finished request's tokens and return them: an engine that runs for long must
        release every request it finished, or it keeps all their tokens."""
        assert request.is_finished, f"{request} is not finished"
        return self.executor.remove(request)


def run_requests(
    engine: LLMEngine,
    requests: Sequence[Request],
    prompts: Sequence[Sequence[int]],
    params: Sequence[SamplingParams],
    *,
    wall_clock: bool,
    chains: Sequence[Sequence[Sequence[Request]]] = (),
    on_progress: Callable[[int], None] | None = None,
) -> float:
    """Replay ``requests`` (their arrival times set) through ``engine``; returns the wall seconds.

    ``wall_clock``: arrivals happen on the wall clock (the engine idles until the next one) and
    timestamps are wall seconds since the start; otherwise the clock is the sum of measured step
    times, jumping over idle gaps (a replay with the same step times, no waiting). Closed-loop
    ``chains`` work as in ``simulate``: a batch after the first arrives when the one before it is done.
    """
    index = {id(r): i for i, r in enumerate(requests)}
    for i, r in enumerate(requests):  # validate every request before running any
        engine.check_request(prompts[i], params[i], where=f"request {r.request_id}")
    closed_loop = ClosedLoopBatches(chains)
    pending = [(r.arrival_time, r.request_id, i) for i, r in enumerate(requests) if closed_loop.arrives_on_its_own(r)]
    heapq.heapify(pending)
    replica, start, done = engine.replica, time.perf_counter(), 0
    replica.now = 0.0
    while pending or engine.has_unfinished():
        now = time.perf_counter() - start if wall_clock else replica.now
        while pending and pending[0][0] <= now:
            _, _, i = heapq.heappop(pending)
            engine.add_request(prompts[i], params[i], requests[i].arrival_time, request=requests[i])
        next_arrival = pending[0][0] if pending else math.inf
        if not engine.has_unfinished():
            if wall_clock:
                time.sleep(max(0.0, next_arrival - now))
            else:
                replica.now = next_arrival
            continue
        if wall_clock:
            replica.now = time.perf_counter() - start
        finished = engine.step(next_arrival)
        done += len(finished)
        for r in finished:
            engine.release(r)
            for x in closed_loop.done(r):  # the next batch arrives now (a turn after its think time)
                x.arrival_time = r.finish_time + x.think_time_s
                heapq.heappush(pending, (x.arrival_time, x.request_id, index[id(x)]))
        if on_progress is not None:
            on_progress(done)
    return time.perf_counter() - start


def synthetic_prompt(num_tokens: int, vocab_size: int, rng: np.random.Generator) -> list[int]:
    """Random token ids for a trace request that has lengths but no text."""
    return rng.integers(0, vocab_size, size=num_tokens).tolist()
