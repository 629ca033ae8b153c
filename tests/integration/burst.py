"""Submit a burst of identical dedup submits from threads; print what each got as JSON.

Run as ``python -m tests.integration.burst MODE COUNT THREADS TAG`` (a separate process).
"""

from __future__ import annotations

import json
import sys
import threading
from typing import Any

from conveyor.dedup import Dedup

TTL = 0.3
POLICIES = {
    "simple": Dedup(mode="simple", key="burst:{note}"),
    "throttle": Dedup(mode="throttle", key="burst:{note}", ttl=TTL),
    # A window far longer than the burst takes, even on a loaded machine (CI saw one of
    # 3 s run out mid-burst): one job, whatever the pace.
    "debounce": Dedup(mode="debounce", key="burst:{note}", window=30.0, max_wait=120.0),
}


def burst(
    platform: Any, mode: str, count: int, threads: int, tag: str, offset: int = 0
) -> list[dict[str, Any]]:
    """``count`` submits over ``threads`` threads released together by a barrier."""
    results: list[dict[str, Any]] = []
    lock = threading.Lock()
    barrier = threading.Barrier(threads)
    per = [count // threads + (1 if i < count % threads else 0) for i in range(threads)]

    def work(start: int, n: int) -> None:
        barrier.wait()
        for i in range(start, start + n):
            h = platform.submit(
                "conveyor.demo.effect", {"note": tag, "sleep": i / 10**6}, dedup=POLICIES[mode]
            )
            with lock:
                results.append(
                    {"job": h.id, "dup": h.deduplicated, "at": h.dedup_at, "seq": h.dedup_seq, "i": i}
                )

    starts = [offset + sum(per[:k]) for k in range(threads)]
    ts = [threading.Thread(target=work, args=(starts[k], per[k])) for k in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return results


if __name__ == "__main__":
    from config.celery_app import platform as p

    mode, count, threads, tag, offset = (
        sys.argv[1],
        int(sys.argv[2]),
        int(sys.argv[3]),
        sys.argv[4],
        int(sys.argv[5]),
    )
    p.engine.connect().close()
    print("READY", flush=True)
    p.redis.blpop([f"{tag}:go"], timeout=60)  # every process starts its burst together
    print(json.dumps(burst(p, mode, count, threads, tag, offset)))
