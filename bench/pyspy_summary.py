"""Summarize a py-spy speedscope profile of the server's processes (`py-spy record -f speedscope --idle
--subprocesses`, as `bench/serve_vs_offline.sh --py-spy` takes it): per thread, a timeline of how busy it
was in windows of `--window-s` (idle = waiting in the event loop, a poll or a lock), the busiest window's
leading frames, and over the whole profile the functions with the most busy samples (self and inclusive).

  python bench/pyspy_summary.py pyspy-server.json [--window-s 0.25] [--top 25] [--from-s T] [--min-busy-s 0.5]
  python bench/pyspy_summary.py pyspy-server.json --where put_executable_and_time,ExecutableCache.store,get_cache_key
"""
from __future__ import annotations

import argparse
import collections
import json

# Leaf frames where a thread waits rather than works (the event loop's poll, ZeroMQ's, locks, sleeps).
IDLE_LEAVES = ("Runner.run (asyncio/runners.py", "select (selectors.py", "_PollLikeSelector.select",
               "Poller.poll", "poll (zmq", "wait (threading.py", "Condition.wait", "Event.wait", "sleep",
               "_worker (concurrent/futures/thread.py", "Queue.get", "epoll", "wait_lost", "recv",
               "_wait_for_tstate_lock")


def short_path(path: str) -> str:
    """site-packages/x/y.py -> x/y.py; a standard-library or repository path -> its last two parts."""
    if "site-packages/" in path:
        return path.split("site-packages/")[-1]
    return "/".join(path.split("/")[-2:])


def is_idle(frame_name: str) -> bool:
    return any(key in frame_name for key in IDLE_LEAVES)


def summarize(path: str, window_s: float, top: int, min_busy_s: float, from_s: float = 0.0) -> str:
    doc = json.load(open(path))
    frames = doc["shared"]["frames"]
    names = [f"{f['name']} ({short_path(f.get('file', '?'))}:{f.get('line', '?')})" for f in frames]
    files = [f.get("file", "") for f in frames]
    # our code: not an installed package, not the standard library
    own = [not ("site-packages" in p or "/lib/python3" in p or p.startswith("<")) for p in files]
    lines = []
    for prof in doc["profiles"]:
        samples, weights = prof["samples"], prof["weights"]
        busy_s = sum(w for s, w in zip(samples, weights) if s and not is_idle(names[s[-1]]))
        if busy_s < min_busy_s:
            continue
        lines.append(f"## {prof['name']}: {sum(weights):.2f} s sampled, {busy_s:.2f} s busy")
        t, windows = 0.0, collections.defaultdict(lambda: [0.0, 0.0, collections.Counter()])
        self_s, incl_s = collections.Counter(), collections.Counter()
        for s, w in zip(samples, weights):
            win = windows[int(t // window_s)]
            t += w
            win[1] += w
            if not s or is_idle(names[s[-1]]):
                continue
            win[0] += w
            # the deepest frame of our own code or the web stack says what the busy time was for
            win[2][next((names[i] for i in reversed(s) if own[i]), names[s[-1]])] += w
            if t - w < from_s:
                continue
            self_s[names[s[-1]]] += w
            for i in set(s):
                incl_s[names[i]] += w
        lines.append(f"timeline ({window_s:g} s windows; a run of windows with the same leading frame of our "
                     "code is one line): start, end, busy fraction, leading frame")
        run: list = []          # [start window, end window, busy, total, lead]

        def flush() -> None:
            if run:
                lines.append(f"  {run[0] * window_s:7.2f}-{(run[1] + 1) * window_s:7.2f} s  "
                             f"{run[2] / max(run[3], 1e-9):5.0%}  {run[4][:100]}")
        for k in sorted(windows):
            busy, total, lead = windows[k]
            first = lead.most_common(1)[0][0] if busy / max(total, 1e-9) >= 0.05 else "(idle)"
            if run and run[4] == first and run[1] == k - 1:
                run[1], run[2], run[3] = k, run[2] + busy, run[3] + total
            else:
                flush()
                run = [k, k, busy, total, first]
        flush()
        lines.append(f"busy from {from_s:g} s on, self (s):")
        lines += [f"  {v:7.3f}  {k[:140]}" for k, v in self_s.most_common(top)]
        lines.append("busy, inclusive (s):")
        lines += [f"  {v:7.3f}  {k[:140]}" for k, v in incl_s.most_common(top)]
    return "\n".join(lines)


def where(path: str, keys: list[str], min_s: float = 0.05) -> str:
    """Per thread: the seconds of its samples whose stack holds each of `keys` (a frame name containing it; a
    sample counts for the first key it holds, else "other"). With a profile taken with py-spy's --gil, what
    each thread held the GIL doing."""
    with open(path) as f:
        doc = json.load(f)
    names = [fr["name"] for fr in doc["shared"]["frames"]]
    rows = []
    for prof in doc["profiles"]:
        spent: collections.Counter = collections.Counter()
        for s, w in zip(prof["samples"], prof["weights"]):
            stack = [names[i] for i in s]
            spent[next((k for k in keys if any(k in n for n in stack)), "other")] += w
        if sum(spent.values()) >= min_s:
            rows.append(f"{sum(spent.values()):7.2f} s  {prof['name'][:70]}: "
                        + ", ".join(f"{k} {spent[k]:.2f}" for k in [*keys, "other"] if spent[k]))
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("profile")
    p.add_argument("--window-s", type=float, default=0.25)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--from-s", type=float, default=0.0, help="totals count samples from here on (the timeline "
                   "shows when serving began)")
    p.add_argument("--min-busy-s", type=float, default=0.5, help="skip threads busy less than this")
    p.add_argument("--where", default=None, metavar="KEY,KEY",
                   help="instead: per thread, the seconds of samples whose stack holds each frame-name part")
    args = p.parse_args()
    if args.where:
        print(where(args.profile, args.where.split(",")))
        return
    print(summarize(args.profile, args.window_s, args.top, args.min_busy_s, args.from_s))


if __name__ == "__main__":
    main()
