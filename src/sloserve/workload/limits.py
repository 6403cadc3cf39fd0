"""The largest values a workload may name, in a spec, a trace file or a flag: far past what real
serving sees, and small enough that building the workload can neither overflow numpy's 64-bit
integers nor ask for more memory than a laptop has. Each limit is refused in one line naming it."""

# Requests in one workload, over all its streams (a run keeps a few hundred bytes per request).
MAX_NUM_REQUESTS = 10_000_000
# Tokens of one length: a prompt, an output, max_tokens, a system prompt. Past any model's context, to
# which requests are clipped after. NOTE: 10^30 once overflowed int64 (a traceback).
MAX_LENGTH_TOKENS = 1_000_000_000
# |priority| (vLLM's: the lower, the sooner).
MAX_PRIORITY = 1_000_000_000
# Burstiest gamma arrivals (coefficient of variation; the gaps' shape is 1/cv^2): tens of times what
# published traces show (BurstGPT's fits are below 10). NOTE: cv 1e300 once divided by zero.
MAX_ARRIVAL_CV = 100.0
