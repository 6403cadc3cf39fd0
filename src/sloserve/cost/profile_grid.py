"""The grid of batch shapes ``sloserve profile`` measures (no torch: the benchmarks and tests that
price the same grid with another cost model use it too)."""

from __future__ import annotations

from dataclasses import dataclass

# A profiled batch: prefill chunks as (c, m) pairs (c tokens after m cached) and the cached tokens of
# each decode.
Batch = tuple[list[tuple[int, int]], list[int]]


def spread_decode_lens(num_decode: int, mean_kv: int, max_kv: int) -> list[int]:
    """``num_decode`` cached-token counts averaging ``mean_kv``, spread evenly over (0, 2 * mean_kv]
    (capped at ``max_kv``) as a live batch's are: fresh requests decode beside long-running ones.

    NOTE: a batch of equal lengths would hide what a backend pays for unequal ones (the reference
    backend pads decodes within a group of similar lengths; a kernel's programs finish unevenly).
    """
    return [min(max_kv, round(2 * mean_kv * (i + 1) / (num_decode + 1))) for i in range(num_decode)]


@dataclass(frozen=True)
class ProfileGrid:
    """The shapes measured: prefill chunks x cached tokens (and short chunks after the longest cached
    context, as prefix caching runs them), batches of several prompts (batch sizes x
    chunk sizes, up to the largest chunk in all), decode batch sizes x mean cached tokens per decode
    (``spread_decode_lens``), lopsided decode batches (one long context among short ones: the longest
    context and the summed KV part ways, so a fit tells ``w_d`` from ``a_d``), and mixed batches
    (each decode batch with the middle prefill chunk)."""

    prefill_chunks: tuple[int, ...] = (32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
    context_lens: tuple[int, ...] = (0, 512, 2048)
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    decode_kv_lens: tuple[int, ...] = (128, 512, 2048)

    def shapes(self, max_model_len: int, max_slots: int) -> list[Batch]:
        """The grid's batches that fit the context and ``max_slots`` KV slots."""
        points: list[Batch] = []
        # NOTE: a batch of more than max_slots requests never fits (each holds a slot): its lists of
        # decode lengths are not built at all (--batch-sizes 10^12 once hung here building them)
        batch_sizes = [b for b in self.batch_sizes if b <= max_slots]
        for c in self.prefill_chunks:
            for m in self.context_lens:
                if c + m <= max_model_len and c + m <= max_slots:
                    points.append(([(c, m)], []))
        # A short new message after the longest cached history (prefix caching: a conversation's next
        # turn computes its message while attention reads the whole context).
        for c in self.prefill_chunks:
            m = max_model_len - c
            if c <= 512 and m > max(self.context_lens) and max_model_len <= max_slots:
                points.append(([(c, m)], []))
        # Batches of k prompts of c tokens each, as vLLM prefills every waiting prompt that fits at
        # once: the cost per prefill (s_p) is identified only where the number of prefills varies.
        for k in batch_sizes:
            for c in self.prefill_chunks:
                if k > 1 and k * c <= max(self.prefill_chunks) and c <= max_model_len and k * c <= max_slots:
                    points.append(([(c, 0)] * k, []))

        def decodes(b: int, m: int) -> list[int]:
            return spread_decode_lens(b, m, max_model_len - 1)

        for b in batch_sizes:
            for m in self.decode_kv_lens:
                lens = decodes(b, m)
                if m + 1 <= max_model_len and sum(lens) + b <= max_slots:
                    points.append(([], lens))
        # NOTE: live batches' longest context is 2-8x their mean (docs/simulator.md); the spread
        # batches above reach only 2x.
        longest = min(4 * max(self.decode_kv_lens), max_model_len - 1)
        for b in batch_sizes:
            lens = [min(self.decode_kv_lens)] * (b - 1) + [longest]
            if b > 1 and sum(lens) + b <= max_slots:
                points.append(([], lens))
        chunks = [c for c in self.prefill_chunks if c <= max_model_len]
        if chunks:
            c = chunks[len(chunks) // 2]
            m = self.decode_kv_lens[len(self.decode_kv_lens) // 2]
            for b in batch_sizes:
                lens = decodes(b, m)
                if m + 1 <= max_model_len and sum(lens) + b + c <= max_slots:
                    points.append(([(c, 0)], lens))
        return points
