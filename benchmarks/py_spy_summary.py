"""Where a served engine's threads spend their time: a summary of py-spy's raw samples, as
``serve_overhead.py --py-spy FILE`` records them (``py-spy record --format raw --threads --idle``: one
line a stack, its frames joined by ``;``, its count last).

    python benchmarks/py_spy_summary.py FILE [--top 12]

For each process (the engine core's, the one multiprocessing spawned; the server's; any other) and
each of its threads, the samples taken; then, for each thread with at least --min-share of the
process's samples, the places it was found most: the deepest sloserve frame of each stack, and the
stack's last frame where that is another library's (``compute_logits > Linear.forward``), as a share of
the thread's samples. With ``--idle`` the samples of a thread waiting (on a pipe, an event, the GIL) are in the count:
the engine core's shares then say where it waits as well as where it works. The serve stage of
``gpu_session.sh`` prints this to its log, so it comes back even without the samples' file.
"""

from __future__ import annotations

import argparse
from collections import Counter, defaultdict
from pathlib import Path

OWN = "sloserve/"  # a frame of ours: "function (sloserve/module.py:line)"


def where(frames: list[str]) -> str:
    """The deepest sloserve frame of a stack, and the stack's last frame where that is another library's."""
    ours = [i for i, frame in enumerate(frames) if OWN in frame]
    if not ours:
        return frames[-1]
    deepest = ours[-1]
    return frames[deepest] if deepest == len(frames) - 1 else f"{frames[deepest]} > {frames[-1]}"


def process_name(header: str) -> str:
    """What a process is, from py-spy's ``process PID:"command line"`` frame."""
    if "spawn_main" in header:
        return "engine core"
    if "sloserve" in header and " serve" in header:
        return "server"
    return header.split(":", 1)[-1].strip('"')[:60]


def summary(lines: list[str], top: int, min_share: float) -> list[str]:
    """The report's lines for py-spy raw ``lines``."""
    # (process, thread) -> place -> samples
    places: dict[tuple[str, str], Counter[str]] = defaultdict(Counter)
    for line in lines:
        stack, _, count = line.rstrip().rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        headers = [f for f in frames if f.startswith("process ")]  # (the process and those that started it)
        process = process_name(headers[-1]) if headers else "(one process)"
        thread = next((f.split(": ", 1)[-1] for f in frames if f.startswith("thread (")), "(one thread)")
        body = [f for f in frames if not f.startswith(("process ", "thread ("))]
        places[process, thread][where(body) if body else "(no frame)"] += int(count)
    out = []
    for process in dict.fromkeys(p for p, _ in sorted(places, key=lambda key: key[0] != "engine core")):
        threads = {thread: counts for (p, thread), counts in places.items() if p == process}
        total = sum(sum(c.values()) for c in threads.values())
        if not total:
            continue
        out.append(f"\n{process}: {total} samples")
        for thread, counts in sorted(threads.items(), key=lambda item: -sum(item[1].values())):
            samples = sum(counts.values())
            out.append(f"  {thread}: {samples} samples ({samples / total:.0%})")
            if samples / total < min_share:
                continue
            for place, n in counts.most_common(top):
                out.append(f"    {n / samples:6.1%}  {place}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("file", type=Path)
    parser.add_argument("--top", type=int, default=12, help="places shown a thread")
    parser.add_argument("--min-share", type=float, default=0.05, help="of its process's samples, to show its places")
    args = parser.parse_args()
    print(f"py-spy samples in {args.file}, by process and thread:")
    print("\n".join(summary(args.file.read_text().splitlines(), args.top, args.min_share)))


if __name__ == "__main__":
    main()
