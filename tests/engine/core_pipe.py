"""The server's side of an engine core's pipe, for tests that drive ``EngineCore`` in-process: what it
sent each request, checking that nothing follows a request's finish."""

from __future__ import annotations

from collections import defaultdict
from multiprocessing.connection import Connection

from sloserve.engine.engine_core import Output, outputs_of


class CorePipe:
    """Reads an ``EngineCore``'s messages: each request's tokens in order (``tokens``), their
    log-probabilities and its prompt's where it asked for them, its finish reason (``reasons``), and the answers
    to prefix cache resets (``resets``)."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.tokens: dict[int, list[int]] = defaultdict(list)
        self.reasons: dict[int, str] = {}
        self.logprobs: dict[int, list] = {}
        self.prompt_logprobs: dict[int, list] = {}
        self.resets: list[bool] = []  # the answers to ("reset_prefix_cache",), in order

    def read(self) -> list[Output]:
        """Every message sent since the last read; returns their outputs."""
        outputs = []
        while self.conn.poll():
            kind, columns, _ = self.conn.recv()
            if kind == "reset_prefix_cache":
                self.resets.append(columns)
                continue
            for out in outputs_of(columns):
                assert out.request_id not in self.reasons, "news after a request's last output"
                self.tokens[out.request_id] += out.token_ids
                if out.logprobs is not None:
                    assert len(out.logprobs) == len(out.token_ids)
                    self.logprobs.setdefault(out.request_id, []).extend(out.logprobs)
                if out.prompt_logprobs is not None:
                    assert out.request_id not in self.prompt_logprobs, "a prompt's log-probabilities sent once"
                    self.prompt_logprobs[out.request_id] = out.prompt_logprobs
                if out.finish_reason is not None:
                    self.reasons[out.request_id] = out.finish_reason
                outputs.append(out)
        return outputs
