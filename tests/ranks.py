"""Many ranks on one machine: a pool of worker processes, each a rank of one process group, that run test
functions sent to them (the pattern of PyTorch's own distributed tests, with the processes kept between tests
so that each test does not pay for starting interpreters and groups).

``pool.run(fn, *args)`` runs ``fn(*args)`` on every rank at once and returns the per-rank results; an exception
on any rank is raised here with that rank's traceback. ``fn`` must be importable by name (a module-level
function of a test module).
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import socket
import traceback


class RankError(AssertionError):
    pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(rank, world_size, port, backend, env, connection):
    import faulthandler

    faulthandler.enable()  # a rank that crashes says where
    os.environ.update(env)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    import torch
    import torch.distributed as dist

    if torch.accelerator.is_available():
        torch.accelerator.set_device_index(rank % torch.accelerator.device_count())
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=60),
    )
    connection.send(("ready", None))
    while True:
        message = connection.recv()
        if message is None:
            break
        fn, args = message
        try:
            connection.send(("ok", fn(*args)))
        except BaseException as exc:  # report everything, keep serving
            connection.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    dist.destroy_process_group()
    connection.close()


class RankPool:
    def __init__(self, world_size: int = 2, backend: str = "gloo", env: dict | None = None, timeout: float = 120):
        context = multiprocessing.get_context("spawn")
        self.world_size = world_size
        self.timeout = timeout
        port = _free_port()
        self._connections = []
        self._processes = []
        for rank in range(world_size):
            parent, child = context.Pipe()
            process = context.Process(
                target=_serve, args=(rank, world_size, port, backend, dict(env or {}), child), daemon=True
            )
            process.start()
            self._connections.append(parent)
            self._processes.append(process)
        for rank, connection in enumerate(self._connections):
            self._receive(rank, connection)

    def _receive(self, rank, connection):
        if not connection.poll(self.timeout):
            self.close(kill=True)
            raise RankError(f"rank {rank} did not answer within {self.timeout} s (a hang?)")
        return connection.recv()

    def run(self, fn, *args) -> list:
        for connection in self._connections:
            connection.send((fn, args))
        replies = [self._receive(rank, c) for rank, c in enumerate(self._connections)]
        errors = [f"--- rank {rank}: {payload}" for rank, (kind, payload) in enumerate(replies) if kind == "error"]
        if errors:
            raise RankError("\n".join(errors))
        return [payload for _, payload in replies]

    def run_expecting_errors(self, fn, *args) -> list[str]:
        """Run ``fn`` on every rank; return each rank's error text, failing if any rank succeeded."""
        try:
            self.run(fn, *args)
        except RankError as exc:
            texts = str(exc).split("--- rank ")[1:]
            if len(texts) != self.world_size:
                raise
            return texts
        raise AssertionError("no rank raised")

    def close(self, kill: bool = False):
        for connection, process in zip(self._connections, self._processes):
            if not kill and process.is_alive():
                try:
                    connection.send(None)
                except (BrokenPipeError, OSError):
                    pass
        for process in self._processes:
            process.join(timeout=0 if kill else 30)
            if process.is_alive():
                process.kill()
        self._connections, self._processes = [], []
