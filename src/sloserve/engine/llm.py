"""The offline entry point vLLM users know: ``LLM(model=...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from sloserve.checkpoint.generation_config import sampling_defaults
from sloserve.core.errors import ConfigError
from sloserve.core.request import Request
from sloserve.cost.base import CostModel
from sloserve.engine import beam_search
from sloserve.engine.beam_search import BeamSearchParams
from sloserve.engine.chat_template import ChatTemplate
from sloserve.engine.detokenizer import Detokenizer
from sloserve.engine.llm_engine import LLMEngine
from sloserve.engine.loader import load_model
from sloserve.engine.logprobs import Logprobs, cumulative_logprob
from sloserve.engine.sampler import SamplingParams

# A text, or vLLM's TokensPrompt: {"prompt_token_ids": [...]}, with its "cache_salt" (the prompt's cached blocks
# are shared only with prompts of the same salt)
Prompt = str | dict[str, Any]


@dataclass
class CompletionOutput:
    index: int
    text: str  # with a stop string: the text before it
    token_ids: list[int]  # with a stop string: up to the token that completed it (vLLM's)
    finish_reason: str  # "stop" (EOS, a stop token or string) or "length" (max_tokens)
    # With SamplingParams.logprobs: each token's log-probabilities, and their sum
    logprobs: list[Logprobs] | None = None
    cumulative_logprob: float | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string it ended on (EOS, length: None)


@dataclass
class RequestOutput:
    """One prompt's result (vLLM's shape: ``outputs[0].token_ids`` / ``.text``; ``SamplingParams.n``
    sequences in ``outputs``)."""

    request_id: int  # the engine request of its first sequence
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache (vLLM's field)
    # With SamplingParams.prompt_logprobs: None for the first prompt token, then each one's
    prompt_logprobs: list[Logprobs | None] | None = None


@dataclass
class BeamSearchSequence:
    """One of the best beams (vLLM's shape): ``tokens`` and ``text`` hold the prompt too."""

    tokens: list[int]
    logprobs: list[Logprobs]  # each output token's, with the 2 * beam_width likeliest
    cum_logprob: float
    text: str
    finish_reason: str  # "stop" (EOS) or "length"


@dataclass
class BeamSearchOutput:
    """A prompt's best beams, best first."""

    sequences: list[BeamSearchSequence]


class LLM:
    """A model served by a registered scheduler, for offline batches.

    Args:
        model: a local HF directory (config.json, *.safetensors, tokenizer.json) or ``random:NAME``.
        scheduler: a registered policy (``sloserve schedulers``); ``**scheduler_options`` set its
            knobs as ``--set`` does (e.g. ``preemption="swap"``, ``block_size=8``).
        device: ``cpu`` or ``cuda``. kv_capacity_tokens: KV slots (default: see LLMEngine).
        dtype: ``auto`` (float32 on CPU, the checkpoint's on CUDA), float32, float16, bfloat16.
        cost_model: what a policy that estimates batch times (BROS) uses: a preset or a JSON file.
        attention_backend: ``auto`` (Triton kernels on CUDA when triton is installed, else the
            PyTorch reference), ``torch`` or ``triton``.
        cuda_graphs: replay decode-only steps as CUDA graphs (``cuda_graphs``; needs cuda and the
            triton backend). ``None`` (the default): on wherever supported, as vLLM captures by default.
        enable_prefix_caching: share the KV blocks of prompts' common prefixes (and of answers a
            conversation resends). ``None`` (the default): on wherever the scheduler supports it, as
            vLLM v1; ``True`` with one that does not is an error.
        async_scheduling: launch each step before the step before's tokens are on the host, as vLLM's
            ``async_scheduling`` (``async_scheduling.py``). ``None`` (the default): on CUDA unless
            SLOSERVE_ASYNC_SCHEDULING=0.
    """

    def __init__(
        self,
        model: str,
        scheduler: str = "vllm",
        device: str = "cpu",
        kv_capacity_tokens: int | None = None,
        *,
        dtype: str = "auto",
        seed: int = 0,
        max_model_len: int | None = None,
        swap_space_tokens: int | None = None,
        cost_model: str | CostModel | None = None,
        attention_backend: str = "auto",
        cuda_graphs: bool | None = None,
        enable_prefix_caching: bool | None = None,
        async_scheduling: bool | None = None,
        **scheduler_options: Any,
    ) -> None:
        self.model = model
        self.loaded = load_model(
            model, device=device, dtype=dtype, seed=seed, attention_backend=attention_backend, cuda_graphs=cuda_graphs
        )
        self._chat_template: ChatTemplate | None = None  # read on the first chat
        self.engine = LLMEngine(
            self.loaded,
            scheduler,
            kv_capacity_tokens=kv_capacity_tokens,
            swap_space_tokens=swap_space_tokens,
            max_model_len=max_model_len,
            cost_model=cost_model,
            seed=seed,
            scheduler_options=scheduler_options,
            enable_prefix_caching=enable_prefix_caching,
            async_scheduling=async_scheduling,
        )

    @property
    def tokenizer(self):
        return self.loaded.tokenizer

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's ``LLM.reset_prefix_cache``): the next call computes its prompts
        afresh, as a cold engine would (a benchmark's runs start alike). True: between calls no request
        holds KV."""
        return self.engine.reset_prefix_cache()

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` samples with when given no params: the model's generation config's
        temperature, top_p, top_k, min_p and repetition_penalty (``checkpoint/generation_config.py``),
        else the API's defaults (vLLM's ``LLM.get_default_sampling_params``). A new one each call."""
        return SamplingParams(**self._sampling_defaults)

    @functools.cached_property
    def _sampling_defaults(self) -> dict[str, float]:
        """NOTE: the file is read once, at the first call (as vLLM keeps them), not at every ``generate``."""
        return sampling_defaults(self.model)

    def _token_ids(self, prompt: Prompt, index: int) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.loaded.tokenizer is None:
                raise ConfigError(
                    f"prompt {index}: the model has no tokenizer.json; pass {{'prompt_token_ids': [...]}}"
                )
            return prompt, self.loaded.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            salt = prompt.get("cache_salt")
            if salt is not None and not (isinstance(salt, str) and salt):
                raise ConfigError(f"prompt {index}: cache_salt must be a non-empty string, got {salt!r}")
            return None, list(prompt["prompt_token_ids"])
        raise ConfigError(
            f"prompt {index}: expected a string or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}"
        )

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate for every prompt; results in input order. Every prompt is checked before any runs.

        Each of a prompt's ``n`` sequences is an engine request of its own (the scheduler sees each;
        they share the prompt's KV blocks through the prefix cache). A stop string ends its sequence
        in the step that completes it (the engine drops it there), as the server does. ``use_tqdm``:
        a progress bar of the finished sequences on stderr (vLLM's name; off by default here)."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = (
            [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        )
        if len(params) != len(prompts):
            raise ConfigError(f"{len(params)} sampling params for {len(prompts)} prompts")
        encoded = [self._token_ids(p, i) for i, p in enumerate(prompts)]
        tokenizer = self.loaded.tokenizer
        params = [
            self.engine.check_request(ids, p, where=f"prompt {i}")
            for i, ((_, ids), p) in enumerate(zip(encoded, params))
        ]
        if tokenizer is None and any(p.stop for p in params):
            raise ConfigError("stop strings need the model's tokenizer (tokenizer.json); this model has none")
        engine = self.engine
        salts = [prompt.get("cache_salt") if isinstance(prompt, dict) else None for prompt in prompts]
        sequences = [
            [engine.add_request(ids, p.for_choice(j), cache_salt=salt) for j in range(p.n)]
            for (_, ids), p, salt in zip(encoded, params, salts, strict=True)
        ]
        stops = {r: Detokenizer.for_params(tokenizer, p) for rs, p in zip(sequences, params) if p.stop for r in rs}
        watched = dict(stops)  # the sequences whose text may still hold a stop string
        with _progress_bar(sum(len(rs) for rs in sequences), enabled=use_tqdm) as advance:
            while engine.has_unfinished():
                done = engine.step()
                advance(len(done))
                self._end_stopped(watched, done)
        outputs = []
        for requests, (text, ids) in zip(sequences, encoded, strict=True):
            completions = [self._completion(j, r, stops.get(r)) for j, r in enumerate(requests)]
            prompt_logprobs = completions[0][1]
            first = requests[0]
            outputs.append(
                RequestOutput(
                    first.request_id, text, ids, [c for c, _ in completions], first.num_cached_tokens, prompt_logprobs
                )
            )
        return outputs

    def beam_search(
        self, prompts: Prompt | Sequence[Prompt], params: BeamSearchParams, *, use_tqdm: bool = False
    ) -> list[BeamSearchOutput]:
        """vLLM's ``LLM.beam_search`` (``engine/beam_search.py``): each prompt's best
        ``params.beam_width`` beams; the prompts' searches run side by side, each step one batch of
        every live beam's next token."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        encoded = [self._token_ids(p, i)[1] for i, p in enumerate(prompts)]
        step = params.step_params()
        # NOTE: as vLLM, max_tokens is cut to what each prompt's context leaves
        fits = [
            self.engine.check_request(ids, dataclasses.replace(step, max_tokens=params.max_tokens), f"prompt {i}")
            for i, ids in enumerate(encoded)
        ]
        eos = self.engine.executor.eos_token_ids
        searches = [
            beam_search.search(ids, dataclasses.replace(params, max_tokens=fit.max_tokens), eos)
            for ids, fit in zip(encoded, fits, strict=True)
        ]
        batches = {i: next(s) for i, s in enumerate(searches)}
        found: dict[int, list[beam_search.Beam]] = {}
        while batches:
            order = [(i, ids) for i, batch in batches.items() for ids in batch]
            outs = self.generate([{"prompt_token_ids": ids} for _, ids in order], step, use_tqdm=use_tqdm)
            nexts: dict[int, list[Logprobs]] = {i: [] for i in batches}
            for (i, _), out in zip(order, outs, strict=True):
                nexts[i].append(out.outputs[0].logprobs[0])
            for i, logprobs in nexts.items():
                try:
                    batches[i] = searches[i].send(logprobs)
                except StopIteration as done:
                    found[i] = done.value
                    del batches[i]
        tokenizer = self.loaded.tokenizer
        decode = (lambda ids: tokenizer.decode(ids)) if tokenizer is not None else (lambda ids: "")
        return [
            BeamSearchOutput(
                [
                    BeamSearchSequence(
                        b.token_ids,
                        b.logprobs,
                        b.cumulative_logprob,
                        decode(b.token_ids),
                        "stop" if b.finished else "length",
                    )
                    for b in found[i]
                ]
            )
            for i in range(len(encoded))
        ]

    def _end_stopped(self, watched: dict[Request, Detokenizer], done: list[Request]) -> None:
        """After a step that returned ``done``: the watched sequences whose text now holds a stop string
        are dropped by the engine (their next step frees them); a sequence leaves ``watched`` once
        stopped or returned. NOTE: returned, not finished: with async scheduling the policy finishes a
        request at its ``max_tokens``-th token a step before that token is on the host, and a stop
        string it completes still ends the text there ("stop", as vLLM's)."""
        returned = set(done)
        for request, detokenizer in list(watched.items()):
            new = self.engine.output_token_ids(request, len(detokenizer.token_ids))
            if new:
                detokenizer.push(new, finished=request in returned)
            if detokenizer.stopped and not request.is_finished:
                self.engine.abort(request)
            if detokenizer.stopped or request in returned:
                del watched[request]

    def chat(
        self,
        messages: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """vLLM's ``LLM.chat``: a conversation (``[{"role", "content"}, ...]``), or a list of them, rendered
        by the model's chat template as the server's chat completions render it, then generated
        (``generate``); each output's ``prompt`` is the rendered text. ``tools``: OpenAI's function
        definitions, for templates that show them (the output is not parsed for calls, as in vLLM).
        ``chat_template``: a template (its text, or a file) to use instead of the model's."""
        conversations = _conversations(messages)
        if self.loaded.tokenizer is None:
            raise ConfigError("chat needs the model's tokenizer (tokenizer.json); this model has none")
        if self._chat_template is None:
            self._chat_template = ChatTemplate.for_checkpoint(self.model)
        template = self._chat_template
        if chat_template is not None:
            template = template.replaced_by(chat_template)
        texts = [
            template.render(
                conversation,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                variables=chat_template_kwargs,
                tools=tools,
            )
            for conversation in conversations
        ]
        # NOTE: the model's own template writes its special tokens (BOS): not added again, as vLLM
        encode = functools.partial(self.loaded.tokenizer.encode, add_special_tokens=not template.from_model)
        outputs = self.generate(
            [{"prompt_token_ids": encode(text)} for text in texts], sampling_params, use_tqdm=use_tqdm
        )
        for output, text in zip(outputs, texts, strict=True):
            output.prompt = text
        return outputs

    def _completion(
        self, index: int, request: Request, detokenizer: Detokenizer | None
    ) -> tuple[CompletionOutput, list[Logprobs | None] | None]:
        """A finished sequence's output (its engine state released), and its prompt logprobs."""
        seq = self.engine.release(request)
        ids, logprobs = seq.output_token_ids, seq.logprobs
        if detokenizer is not None and detokenizer.stopped:
            text, reason, stop_reason = detokenizer.text, "stop", detokenizer.stop_reason
            # NOTE: up to the token the stop string was found at: the engine may have sampled more before
            # it heard (with async scheduling, the token its policy finished it on by count)
            ids = ids[: len(detokenizer.token_ids)]
            logprobs = None if logprobs is None else logprobs[: len(ids)]
        else:  # NOTE: the text as the server's detokenizer gives it
            eos = self.engine.executor.eos_token_ids
            stop_token = seq.params.ended_on_stop_token(seq.finish_reason, ids, eos)
            decoded = Detokenizer.for_params(self.loaded.tokenizer, seq.params).push(ids, True, stop_token)
            text, reason, stop_reason = decoded, seq.finish_reason or "length", seq.stop_reason
        cumulative = None if logprobs is None else cumulative_logprob(logprobs)
        completion = CompletionOutput(index, text, ids, reason, logprobs, cumulative, stop_reason)
        return completion, None if seq.prompt_logprobs is None else [None, *seq.prompt_logprobs]


@contextlib.contextmanager
def _progress_bar(total: int, enabled: bool) -> Iterator[Callable[[int], None]]:
    """``advance(n)`` moves a bar of ``total`` sequences on stderr by ``n`` (nothing when not enabled)."""
    if not enabled:
        yield lambda n: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    with Progress(
        "generating", BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=Console(stderr=True)
    ) as bar:
        task = bar.add_task("generating", total=total)
        yield lambda n: bar.advance(task, n)


def _conversations(messages: Any) -> list[list[dict[str, Any]]]:
    """``LLM.chat``'s ``messages`` as a list of conversations, each message a dict with a string ``role``
    and its content a string (OpenAI's text parts joined, as the server joins them); a ConfigError naming
    the first message that is not one."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ConfigError(
            f"chat needs a conversation (a non-empty list of messages) or a list of them, got {messages!r:.80}"
        )
    conversations = [messages] if isinstance(messages[0], dict) else list(messages)
    checked = []
    for i, conversation in enumerate(conversations):
        where = f"conversation {i}"
        if not isinstance(conversation, (list, tuple)) or not conversation:
            raise ConfigError(f"{where}: a conversation is a non-empty list of messages, got {conversation!r:.80}")
        read = []
        for j, message in enumerate(conversation):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise ConfigError(f"{where}, message {j}: a message is a dict with a string role, got {message!r:.80}")
            content = message.get("content")
            if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                content = "".join(str(part.get("text", "")) for part in content)
            if content is not None and not isinstance(content, str):
                raise ConfigError(f"{where}, message {j}: content must be a string or text parts, got {content!r:.80}")
            read.append({**message, "content": content if content is not None else ""})
        checked.append(read)
    return checked
