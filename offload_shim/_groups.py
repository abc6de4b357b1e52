"""What offload_shim keeps per process group: the ranks' agreement on the settings a staged call's wire depends on,
and the staging buffers, streams and copy lanes reserved for the group's chunked calls.

The agreement (:func:`agree`). A chunked call's chunks depend on ``chunk_bytes``, a routed call's backend on
``route_min_bytes`` and ``always_stage``: settings that every rank must set alike, and that torch knows nothing of.
So before the first call on a group whose wire depends on them (a chunkable collective staged, or any host call on
a group with a CPU backend beside an accelerator's), each rank writes its settings (and whether it can stage, and
route) to the group's own store and waits for every other rank's, up to the group's timeout; then every rank
compares the same values and either goes on or raises the same :class:`StagingError`. Again whenever this rank's
settings change. The ranks reach that call together (every rank issues the same collectives), so the agreement
costs one store round trip and a wait for the slowest rank, once per group; a rank that never gets there (its
peers pass accelerator tensors, or run without the shim) leaves the others waiting until the group's timeout, and
then raising, before they send anything.

The buffers (:func:`pool`). A chunked synchronous call takes a pool: two chunks of accelerator memory, two
streams, and pinned bounce buffers for pageable memory, made before the call's first chunk. Pools belong to no
group (making and destroying groups costs no memory): a call takes an idle one of its device, or makes one where
every pool of its device is in use by another thread's call, and gives it back once its copies and collectives are
queued; after the first calls no call allocates, and there are never more pools than calls staged at once. The
copy lanes (:func:`lane`) are the group's: one thread each for host copies into and out of the bounce buffers, and
one (``"done"``) that finishes the group's asynchronous chunked calls in the background, in the order they were made.
A lane's copy may wait on the group's collectives, so one lane serves one group: nothing of one group's calls waits
behind another group's (two threads pipelining on two groups in opposite orders on two ranks would otherwise block
each other). :func:`forget` drops a group's agreement and lanes when the group is destroyed; :func:`release` frees
the pools.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import time

import torch
import torch.distributed as dist

from offload_shim import _config, _devices, _interrupts
from offload_shim._state import state
from offload_shim._staging import current_stream, new_stream
from offload_shim._devices import StagingError

# Raised with the version of what the agreement compares: ranks of two offload_shim versions whose wires may differ
# disagree, rather than send different collectives.
WIRE_VERSION = 2
SLOTS = 2  # chunks in flight on the accelerator in a synchronous chunked call


@dataclasses.dataclass
class _Agreement:
    """What the ranks of a group agreed on, under this rank's ``settings`` (an object: compared by identity first)."""

    settings: object = None
    mine: tuple | None = None  # this rank's fingerprint then
    route: bool = False  # every rank can route through the group's accelerator backend
    unable: dict = dataclasses.field(default_factory=dict)  # group rank -> why it cannot stage


# The served path's answer for host tensors (a group's record's ``below``): the size in bytes below which a host-only
# chunkable call of one tensor on the group goes to torch untouched (``math.inf``: every size, the tensor is not read;
# 0: none, every call is decided). Found by ``_plan.host_answer`` and ``_plan``'s decisions; dropped with what it was
# found from: the group's agreement (replaced by :func:`agree`), the group (:func:`forget`), the settings (every
# configure()). Every change to it is made under ``state.answers_lock``, an answer kept only after its sources are
# checked, under the lock, to be still in force; the wrappers read it without a lock (one attribute).


def drop_answers(group: dist.ProcessGroup | None = None) -> None:
    """Drop the served path's answer for ``group`` (for every group: ``None``)."""
    with state.answers_lock:
        for found in list(state.groups.values()) if group is None else [_devices.record(group)]:
            found.below = None


_config.on_change(drop_answers)  # (configure() puts the new settings in force first)


def keep_answer(group: dist.ProcessGroup, settings, below: float, agreement=None) -> None:
    """Keep ``below`` as the served path's answer for ``group``, found under ``settings`` and, where it depends on
    the ranks' agreement, ``agreement``: unless either is no longer in force, or torch no longer has the group
    (destroyed meanwhile)."""
    found = _devices.record(group)
    with state.answers_lock:
        if settings is not _config.settings() or agreement is not None and found.agreement is not agreement:
            return
        groups = _torch_groups()
        if groups is None or group in groups:
            found.below = below


def _torch_groups():
    """torch's table of the process groups it has (read where torch keeps it now: its tests replace it); ``None``
    where this torch keeps none."""
    return getattr(dist.distributed_c10d._world, "pg_map", None)


def prune() -> None:
    """Drop the records of groups torch no longer has (destroyed while the shim was not installed)."""
    groups = _torch_groups()
    if groups is not None:
        for found in list(state.groups.values()):
            group = found.ref()
            if group is not None and group not in groups:
                forget(group)


def mark_out_of_step(group: dist.ProcessGroup, why: str) -> None:
    """Record that ``group``'s ranks issued collectives that did not match (``why``): every later staged call on it
    is refused, until the group is destroyed (:func:`forget`)."""
    _devices.record(group).out_of_step = why


def _fingerprint(settings, unable: str | None, can_route: bool) -> tuple:
    return (WIRE_VERSION, settings.chunk_bytes, settings.always_stage, settings.route_min_bytes,
            settings.host_staging, unable, can_route)


# What the agreement compares, by position in the fingerprint (unable and can_route are reported, not compared).
_COMPARED = {
    "offload_shim's wire version": 0,
    f"chunk sizes ({_config.ENV_CHUNK_BYTES})": 1,
    f"forced staging ({_config.ENV_ALWAYS_STAGE})": 2,
    f"routing thresholds ({_config.ENV_ROUTE_MIN_BYTES})": 3,
    f"host staging ({_config.ENV_HOST_STAGING})": 4,
}


def agree(group: dist.ProcessGroup, settings, unable: str | None, collective: str, can_route: bool = False):
    """The ranks' agreement on ``group`` under this rank's ``settings`` (see the module docstring): made now if this
    rank has made none under settings like these, else the one it made. ``unable``: why this rank cannot stage on
    the group (``None``: it can); ``can_route``: whether it can route host tensors through the group's accelerator
    backend. Returns the agreement: ``route`` (every rank can route) and ``unable`` (group rank to why it cannot
    stage, for every rank that cannot).

    Raises:
        StagingError: the ranks' settings differ (the same message on every rank), or a rank did not reach its
            agreement within the group's timeout; before anything of the call was sent.
    """
    record = _devices.record(group)
    agreement = record.agreement
    if agreement is not None and agreement.settings is settings and agreement.mine == _fingerprint(
            settings, unable, can_route):
        return agreement
    with record.lock:
        mine = _fingerprint(settings, unable, can_route)
        agreement = record.agreement
        if agreement is None or agreement.mine != mine:
            try:
                _interrupts.hold()  # from here to the end of the call it is for (_interrupts)
                agreement = _exchange(record.store, group.rank(), group.size(), _devices.group_timeout(group),
                                      _devices.group_label(group), mine, unable, collective)
            except BaseException:  # every rank raised at this agreement's number: the next one takes the next
                record.agreement = None
                drop_answers(group)
                raise
            record.agreement = agreement
            drop_answers(group)  # found from the agreement replaced
        agreement.settings = settings
    return agreement


class Unagreeable(Exception):
    """The group's store cannot be written (PyTorch's ``FakeStore``, which its tests' simulated ranks use: "Not
    implemented"): its ranks cannot agree, so nothing is staged on the group (``_plan.decide``)."""


def _exchange(store, rank: int, size: int, timeout, label: str, mine: tuple, unable: str | None,
              collective: str) -> _Agreement:
    """Compare ``mine`` with every rank's fingerprint through the group's store in a constant number of store
    operations per rank, whatever the group's size, as torch's store-based barrier counts its ranks: each rank takes
    the number of its agreement from a counter of its own (so a group made again over the same store goes on from
    the last number, never reading an earlier group's answers), writes its fingerprint under its rank (read only to
    name the ranks on a difference or a timeout), adds one to a counter named by its fingerprint's digest and one to
    the number of ranks arrived, and waits for every rank. When every rank counted the same digest, every
    fingerprint is this rank's; otherwise (one read of every rank's) the ranks are named with their values.
    ``store``: the group's (``None``: nothing to compare through); ``timeout``: a ``timedelta``; ``label``: the
    group's name in messages."""
    if size == 1:
        return _Agreement(mine=mine, route=mine[-1], unable={} if unable is None else {0: unable})
    if store is None:  # a group torch keeps no store for: nothing to compare through
        return _Agreement(mine=mine, route=False)
    try:
        number = store.add(f"offload_shim/agreements/{rank}", 1)
    except RuntimeError as error:  # a store that keeps nothing: on every rank alike
        if "Not implemented" not in str(error) and "pure virtual" not in str(error):  # (FakeStore; a bare Store)
            raise
        raise Unagreeable(str(error)) from error
    prefix = f"offload_shim/agreement/{number}"
    mine_json = json.dumps({"fingerprint": mine, "unable": unable})
    digest = hashlib.sha256(mine_json.encode()).hexdigest()[:32]
    store.set(f"{prefix}/{rank}", mine_json)
    store.add(f"{prefix}/{digest}", 1)
    arrived = store.add(f"{prefix}/arrived", 1)  # after its digest's count: every rank arrived has been counted
    if arrived < size and not _wait_for(store, f"{prefix}/arrived", size, timeout.total_seconds()):  # one never came
        missing = [each for each in range(size) if not store.check([f"{prefix}/{each}"])]
        raise StagingError(
            f"offload_shim: process group {label}: rank(s) {missing} of the group did not "
            f"compare staging settings within the group's timeout ({timeout}), where this rank does before "
            f"{collective} (its first call on the group whose wire depends on them: a staged call, or any host call on "
            f"a group with a CPU and an accelerator backend; or the first since its settings changed). Every rank "
            f"must make the same calls: pass host tensors on every rank, run offload_shim on every rank with the same "
            f"settings, and make the first call on each group in the same order on every rank. Nothing of the call "
            f"was sent; the caller's tensors are unchanged."
        )
    if store.add(f"{prefix}/{digest}", 0) == size:  # every rank's fingerprint is this one
        return _Agreement(mine=mine, route=mine[-1],
                          unable={} if unable is None else dict.fromkeys(range(size), unable))
    values = [json.loads(value) for value in store.multi_get([f"{prefix}/{each}" for each in range(size)])]
    fingerprints = [tuple(value["fingerprint"]) for value in values]
    differ = [what for what, at in _COMPARED.items() if len({f[at] for f in fingerprints}) > 1]
    if differ:
        by_rank = "; ".join(
            f"rank {each}: " + ", ".join(f"{what} {fingerprint[_COMPARED[what]]!r}" for what in differ)
            for each, fingerprint in enumerate(fingerprints)
        )
        raise StagingError(
            f"offload_shim: the ranks of process group {label} disagree on {', '.join(differ)} "
            f"({by_rank}). A staged call's collectives depend on these settings: set them alike on every rank (the "
            f"same environment, or the same offload_shim.configure() calls). No rank ran {collective}; the caller's "
            f"tensors are unchanged."
        )
    return _Agreement(
        mine=mine, route=all(f[-1] for f in fingerprints),
        unable={each: value["unable"] for each, value in enumerate(values) if value["unable"] is not None},
    )


def _wait_for(store, key: str, count: int, timeout: float) -> bool:
    """Whether the counter ``key`` of ``store`` reaches ``count`` within ``timeout`` seconds, polled as torch's
    store-based barrier polls (one operation a poll), at pauses that double up to one of 0.1 ms a rank (at least 50
    ms): the store's load from the polls stays the same whatever the group's size. By polling, not ``store.wait``: a
    process's threads share one store client, and a wait holds it, so one thread waiting for its group's agreement
    would keep another thread from writing its own (two threads agreeing on two groups, in opposite orders on two
    ranks, would wait for each other for ever); and a ``wait`` that times out logs torch's warnings."""
    deadline = time.monotonic() + timeout
    pause, longest = 1e-4, max(0.05, count * 1e-4)
    while store.add(key, 0) < count:
        if time.monotonic() > deadline:
            return False
        time.sleep(pause)
        pause = min(2 * pause, longest)
    return True


# ---------------------------------------------------------------- buffers


def host_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    """``nbytes`` of host memory for copies to and from ``device``: pinned where it is an accelerator."""
    with torch.inference_mode(False):  # reusable by later calls, in inference mode or not
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type != "cpu")


class Pool:
    """Staging buffers and streams for one chunked call at a time, on one device: ``count`` accelerator slots of
    ``slot_bytes`` (``SLOTS`` for a synchronous call; one per chunk for an asynchronous one, which issues every
    chunk before it returns), an H2D and a D2H stream, pinned bounce buffers (two per direction) for pageable
    memory, made by :meth:`bounce` before the call's first chunk, and what the executor makes once per pool
    (``cached``: the chunks' views of the slots as their collectives take them, the agreement's host tensor)."""

    def __init__(self, device: torch.device, slot_bytes: int, generation: int, count: int = SLOTS):
        self.device = device
        self.slot_bytes = slot_bytes
        self.generation = generation
        self.h2d, self.d2h = new_stream(device), new_stream(device)
        with torch.inference_mode(False):  # reused by later calls, in inference mode or not
            self.slots = [torch.empty(slot_bytes, dtype=torch.uint8, device=device) for _ in range(count)]
        self.slot_free: list = [None] * count
        self._bounce: dict[str, list[torch.Tensor]] = {}
        self.bounce_free: list = [None] * SLOTS  # events after the H2D copies out of the "in" bounce buffers
        self.cached: dict = {}

    def bounce(self, direction: str) -> list[torch.Tensor]:
        """The two bounce buffers of ``direction`` (``"in"``: pageable to accelerator, ``"out"``: back)."""
        buffers = self._bounce.get(direction)
        if buffers is None:
            buffers = self._bounce[direction] = [host_buffer(self.slot_bytes, self.device) for _ in range(SLOTS)]
        return buffers

    def buffers(self) -> list[torch.Tensor]:
        return [*self.slots, *(t for pair in self._bounce.values() for t in pair)]

    def synchronize(self) -> None:
        """Wait until no copy or collective queued on the buffers is still running."""
        self.h2d.synchronize()
        self.d2h.synchronize()


# state.idle_pools: idle pools by staging device and kind (:func:`_kind`).


def pool(device: torch.device, slot_bytes: int, count: int = SLOTS) -> Pool:
    """An idle pool of ``device`` with ``count`` slots of ``slot_bytes``, or a new one (see the module docstring);
    idle pools of that device and kind (``SLOTS`` slots, a synchronous call's; or any other count, an asynchronous
    call's) made for another size are freed once their last use has finished: a job whose asynchronous calls vary
    in size keeps one idle pool of their kind per call in flight, not one per size.
    Give it back with :func:`give_back` once the call's copies and collectives are queued (an asynchronous call's:
    once they have run)."""
    stale = []
    with state.pools_lock:
        idle = state.idle_pools.setdefault(_kind(device, count), [])
        while idle:
            found = idle.pop()
            if (found.slot_bytes, len(found.slots), found.generation) == (slot_bytes, count, state.pool_generation):
                break
            stale.append(found)
        else:
            found = None
    for old in stale:
        old.synchronize()
    found = found or Pool(device, slot_bytes, state.pool_generation, count)
    with state.pools_lock:
        state.busy_pools.append(found)
    return found


def _kind(device: torch.device, count: int) -> tuple:
    return str(device), count == SLOTS


def give_back(used: Pool) -> None:
    with state.pools_lock:
        state.busy_pools.remove(used)
        if used.generation == state.pool_generation:
            state.idle_pools.setdefault(_kind(used.device, len(used.slots)), []).append(used)
            return
    used.synchronize()  # release() ran while this call used the pool: freed once its work is done


def discard(used: Pool) -> None:
    """Drop ``used`` without reusing it (a failed call's collectives may still use its memory; the memory is freed
    once nothing holds it)."""
    with state.pools_lock:
        state.busy_pools.remove(used)


def lane(group: dist.ProcessGroup, name: str) -> concurrent.futures.ThreadPoolExecutor:
    """The group's copy lane ``name`` (one thread, made at first use): ``"in"``, host copies into bounce buffers;
    ``"out"``, out of them; ``"done"``, the completion of asynchronous chunked calls. Tasks of one lane run in the
    order submitted; the lanes of two groups never wait for each other."""
    record = _devices.record(group)
    with record.lock:
        executor = record.lanes.get(name)
        if executor is None:
            executor = record.lanes[name] = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix=f"offload_shim_{name}")
    return executor


def completion_lane(group: dist.ProcessGroup) -> concurrent.futures.ThreadPoolExecutor:
    return lane(group, "done")


def pooled_buffers(busy: bool = True) -> list[torch.Tensor]:
    """Every staging buffer the pools hold now, or with ``busy=False`` those of pools no call holds (what a later
    call would take): for tests that count them and poison them between uses."""
    with state.pools_lock:
        pools = (*(state.busy_pools if busy else ()), *(p for idle in state.idle_pools.values() for p in idle))
        return [buffer for each in pools for buffer in each.buffers()]


def copy_streams() -> list:
    """The accelerator streams that staging queues copies of callers' memory on: every pool's H2D and D2H streams (in
    use or idle); with the current stream of each of their devices (where a call staged whole copies), for a wait that
    follows every such copy queued so far (``_registration``)."""
    with state.pools_lock:
        pools = [p for p in (*state.busy_pools, *(p for idle in state.idle_pools.values() for p in idle))
                 if p.device.type != "cpu"]
    streams = [stream for each in pools for stream in (each.h2d, each.d2h)]
    return streams + [current_stream(d) for d in {each.device for each in pools}]


def forget(group: dist.ProcessGroup | None = None) -> None:
    """Drop what is kept for ``group`` (every group for ``None``): its record, with its agreement, its served-path
    answer and its lanes (their threads end once their tasks are done)."""
    for record in _devices.forget(group):
        for executor in record.lanes.values():
            executor.shutdown(wait=False)


def release() -> None:
    """Free the pools once their last use has finished (pools in use are freed when given back)."""
    with state.pools_lock:
        state.pool_generation += 1
        pools = [each for idle in state.idle_pools.values() for each in idle]
        state.idle_pools.clear()
    for each in pools:
        each.synchronize()
