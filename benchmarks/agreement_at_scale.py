"""The ranks' agreement on a group's staging settings at 64 to 1,024 simulated ranks: one ``TCPStore`` server, one
client per simulated rank (a thread each, all released at once), the shim's exchange (``_groups._exchange``)
against the design it replaced (each rank sets its key, polls ``check`` of every rank's key, then ``multi_get``s
them all), and against the harness's own floor (one ``add`` a rank, no wait), alternated in blocks.

    python benchmarks/agreement_at_scale.py [--ranks 64 256 1024] [--blocks 3] [--out FILE.json]

Prints, for each design and size: store operations a rank sends besides its polls for the other ranks, its polls
(the largest counts over the ranks and blocks), the keys all of them name (a ``check`` or ``multi_get`` of N keys
names N), and the time from the release to the last rank's answer (each side's minimum over the blocks), with the
ratio of each size's time to the smallest size's and to the floor's at the same size.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import threading
import time

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from offload_shim import _groups  # noqa: E402

FINGERPRINT = (_groups.WIRE_VERSION, 16 << 20, False, 1 << 20, True, None, True)


class Counting:
    """A store client that counts the operations it sends and the keys they name, each key under ``prefix``."""

    def __init__(self, store, prefix: str):
        self.store, self.prefix, self.operations, self.keys, self.polls = store, prefix, 0, 0, 0

    def _count(self, keys: int) -> None:
        self.operations += 1
        self.keys += keys

    def set(self, key, value):
        self._count(1)
        return self.store.set(self.prefix + key, value)

    def add(self, key, amount):
        self._count(1)
        self.polls += amount == 0 and key.endswith("/arrived")
        return self.store.add(self.prefix + key, amount)

    def check(self, keys):
        self._count(len(keys))
        self.polls += len(keys) > 1
        return self.store.check([self.prefix + key for key in keys])

    def multi_get(self, keys):
        self._count(len(keys))
        return self.store.multi_get([self.prefix + key for key in keys])


def current(store, rank: int, size: int) -> None:
    _groups._exchange(store, rank, size, datetime.timedelta(seconds=300), "simulated", FINGERPRINT, None, "all_reduce")


def replaced(store, rank: int, size: int) -> None:
    """The design before: N keys checked a poll, N read."""
    keys = [f"offload_shim/agreement/1/{each}" for each in range(size)]
    store.set(keys[rank], json.dumps({"fingerprint": FINGERPRINT, "unable": None}))
    pause = 1e-4
    while not store.check(keys):
        time.sleep(pause)
        pause = min(2 * pause, 0.05)
    values = [json.loads(value) for value in store.multi_get(keys)]
    assert len({tuple(v["fingerprint"]) for v in values}) == 1


def floor(store, rank: int, size: int) -> None:
    """The least any agreement sends: one operation a rank, no wait (what the harness itself costs at this size)."""
    store.add("offload_shim/floor", 1)


def measure(design, clients, size: int, tag: str) -> dict:
    """Seconds to the last rank's answer, and the most a rank sent: operations besides its polls, polls, and keys
    named by them all."""
    counting = [Counting(client, tag + "/") for client in clients[:size]]
    start = threading.Barrier(size + 1)
    errors = []

    def rank(each: int) -> None:
        start.wait()
        try:
            design(counting[each], each, size)
        except BaseException as error:  # noqa: BLE001
            errors.append(error)

    threads = [threading.Thread(target=rank, args=(each,)) for each in range(size)]
    for thread in threads:
        thread.start()
    start.wait()
    began = time.perf_counter()
    for thread in threads:
        thread.join()
    seconds = time.perf_counter() - began
    if errors:
        raise errors[0]
    return {"seconds": seconds, "operations": max(c.operations - c.polls for c in counting),
            "polls": max(c.polls for c in counting), "keys": max(c.keys for c in counting)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--blocks", type=int, default=3)
    parser.add_argument("--out")
    args = parser.parse_args()
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=300))
    clients = [dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=datetime.timedelta(seconds=300))
               for _ in range(max(args.ranks))]
    results = {}
    calls = 0
    for block in range(args.blocks):
        designs = [("current", current), ("replaced", replaced), ("floor", floor)]
        for name, design in designs[block % 3:] + designs[: block % 3]:
            for size in args.ranks:
                calls += 1
                found = measure(design, clients, size, f"run{calls}")
                runs = results.setdefault(name, {}).setdefault(size, [])
                runs.append(found)
                print(f"block {block} {name:8} {size:5} ranks: {found['seconds'] * 1e3:9.1f} ms, "
                      f"{found['operations']} operations and {found['polls']} polls naming {found['keys']} keys a rank",
                      flush=True)
    smallest = min(args.ranks)
    print("\n| design | ranks | operations a rank, besides polls | polls a rank | keys a rank | last answer (min) "
          "| x at the smallest size | x the floor |\n| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, by_size in results.items():
        least = min(run["seconds"] for run in by_size[smallest])
        for size, runs in sorted(by_size.items()):
            seconds = min(run["seconds"] for run in runs)
            most = {what: max(run[what] for run in runs) for what in ("operations", "polls", "keys")}
            under = min(run["seconds"] for run in results["floor"][size])
            print(f"| {name} | {size} | {most['operations']} | {most['polls']} | {most['keys']} | "
                  f"{seconds * 1e3:.1f} ms | {seconds / least:.1f} | {seconds / under:.1f} |")
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(results, handle, indent=1)


if __name__ == "__main__":
    main()
