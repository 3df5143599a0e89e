"""Joining and leaving the process group, and the collectives of w8a8_cpu.distributed: init() with a timeout and a
WORLD_SIZE check before the group forms, finish() and the exit handler that tear it down in an order no peer aborts
in, and _collective / all_reduce, which turn a failed or timed-out collective into RankFailure and count it in STATS."""
from __future__ import annotations

import atexit
import datetime
import gc
import os
import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 120.0


class RankFailure(RuntimeError):
    """A collective failed or timed out: another rank most likely died or stalled."""


@dataclass
class CommStats:
    """Time, count and payload of this process's collectives since the last reset()."""
    seconds: float = 0.0
    calls: int = 0
    bytes: int = 0

    def reset(self) -> None:
        self.seconds, self.calls, self.bytes = 0.0, 0, 0


STATS = CommStats()
_timeout_s: Optional[float] = None  # the timeout init() gave the process group, quoted in RankFailure
_finish_store = None  # init()'s rendezvous store (a prefix of it): finish() lets rank 0, its host, leave last


def init(timeout_s: float = DEFAULT_TIMEOUT_S, backend: str = "gloo"):
    """Join the process group described by the environment (torchrun sets RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT) with a timeout, so that a rank that dies makes the others raise RankFailure instead of waiting
    forever. Returns the default group.

    Before the process group forms, every rank publishes its RANK and WORLD_SIZE in the rendezvous store and checks
    them against rank 0's and the others': ranks started with disagreeing settings raise RankFailure naming the
    mismatch within timeout_s (torch alone fails after several timeouts with a store or gloo error)."""
    global _timeout_s, _finish_store
    if timeout_s <= 0:
        raise ValueError(f"timeout_s: must be > 0, got {timeout_s}")
    missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing:
        raise ValueError(f"environment: {', '.join(missing)} not set; start the ranks with torchrun "
                         f"(torchrun --nproc-per-node N -m ...) or set them")
    rank, world_size, port = (_env_int(v) for v in ("RANK", "WORLD_SIZE", "MASTER_PORT"))
    if not 0 <= rank < world_size or not 0 < port < 65536:
        raise ValueError(f"environment: RANK={rank} must be in [0, WORLD_SIZE={world_size}) and MASTER_PORT={port} "
                         f"a port number")
    timeout = datetime.timedelta(seconds=timeout_s)
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"  # torchrun hosts the store
    try:
        store = dist.TCPStore(os.environ["MASTER_ADDR"], port, is_master=rank == 0 and not agent_store,
                              timeout=timeout, wait_for_workers=False)
    except (RuntimeError, OSError) as e:  # DistStoreError / DistNetworkError are RuntimeErrors
        raise RankFailure(f"rank {rank}: cannot reach the rendezvous store at {os.environ['MASTER_ADDR']}:{port} "
                          f"within {timeout_s:g} s: {e}") from e
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")  # an agent's store outlives a restart: fresh keys
    try:
        _agree_on_world(dist.PrefixStore(f"w8a8_cpu/world/{attempt}", store), rank, world_size, timeout_s)
    except RuntimeError as e:
        if isinstance(e, RankFailure):
            raise
        raise RankFailure(f"rank {rank}: lost the rendezvous store while the ranks compared WORLD_SIZE (rank 0 "
                          f"most likely exited): {e}") from e
    dist.init_process_group(backend, store=dist.PrefixStore("w8a8_cpu/pg", store), rank=rank,
                            world_size=world_size, timeout=timeout)
    _timeout_s = timeout_s
    _finish_store = dist.PrefixStore(f"w8a8_cpu/finish/{attempt}", store)
    atexit.unregister(_leave_at_exit)  # one call at exit, however many times init() ran
    atexit.register(_leave_at_exit)
    return dist.group.WORLD


def _env_int(name: str) -> int:
    try:
        return int(os.environ[name])
    except ValueError:
        raise ValueError(f"environment: {name}={os.environ[name]!r} is not an integer") from None


def _agree_on_world(store, rank: int, world_size: int, timeout_s: float) -> None:
    """Every rank's WORLD_SIZE equal, every rank of it present, each RANK taken once: else RankFailure naming it."""
    taken = store.add(f"rank {rank}", 1)
    if taken != 1:
        raise RankFailure(f"rank {rank}: another process was started with RANK={rank} too; give each rank its own")
    store.set(f"world size of rank {rank}", str(world_size))
    deadline = time.monotonic() + timeout_s
    for other in range(world_size):
        key = f"world size of rank {other}"
        while not store.check([key]):
            if time.monotonic() > deadline:
                said = "" if other == 0 else f"; rank 0 says WORLD_SIZE={store.get('world size of rank 0').decode()}" \
                    if store.check(["world size of rank 0"]) else ""
                raise RankFailure(f"rank {rank}: WORLD_SIZE={world_size}, but rank {other} did not join within "
                                  f"{timeout_s:g} s{said}")
            time.sleep(0.05)
        theirs = int(store.get(key).decode())
        if theirs != world_size:
            raise RankFailure(f"rank {rank}: WORLD_SIZE={world_size}, but rank {other} was started with "
                              f"WORLD_SIZE={theirs}; start every rank with the same WORLD_SIZE")


def finish(group=None) -> None:
    """Leave the process group: a barrier (RankFailure if a rank is gone), then destroy_process_group, rank 0 (the
    rendezvous store's host when init() made the group) last, once the others have left (bounded by the timeout).
    No rank tears down its connections, or rank 0 the store, while another still uses them: that has aborted a peer
    in teardown (SIGABRT, "terminate called without an active exception").
    Objects in reference cycles (a caught exception's frames, say) can keep gloo work and its tensors alive until
    interpreter shutdown, where freeing them from gloo's threads takes the GIL and aborts the process (the same
    message; seen rarely, 1 in ~250 local launches and once in CI, in a test whose ranks raise and catch
    ValueErrors): a collection first frees them while the interpreter is whole."""
    gc.collect()
    _collective("final barrier", lambda: dist.barrier(group=group))
    _leave(group)


def _leave(group=None) -> None:
    """finish() after its barrier: the groups torn down in order, rank 0 last."""
    global _finish_store
    whole_world = group is None or group is dist.group.WORLD
    if _finish_store is None or not whole_world:
        dist.destroy_process_group(group)
        return
    # rank 0 hosts the store (init): the others tear their groups down first and say so through it, so that the
    # store's server never goes while a peer's teardown still talks to it (seen: a peer aborted, same message)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if rank != 0:
        dist.destroy_process_group(group)
        _finish_store.add("left", 1)
    else:
        deadline = time.monotonic() + (_timeout_s or DEFAULT_TIMEOUT_S)
        while int(_finish_store.add("left", 0)) < world_size - 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        dist.destroy_process_group(group)
    # the last reference to the store: its connection (on rank 0 its server and the server's thread) closes here,
    # now that every rank is done with it, not in interpreter shutdown; a second collection for cycles through the
    # destroyed group (the first one ran while it was still registered and alive)
    _finish_store = None
    gc.collect()


def _leave_at_exit() -> None:
    """A process that exits with init()'s group still up (an agreement check's ValueError left uncaught, any error
    before finish()) leaves it as finish() does, without the barrier (a rank that failed alone would wait there for
    the timeout, then fail): torch tore it down after the interpreter, where a thread of the group still running
    aborted the process (SIGABRT, "terminate called without an active exception": 1 in ~20 launches of 2 ranks exiting
    on load_sharded's ValueError, issue 50). Rank 0 waits for the others to leave, at most the group's timeout."""
    if not dist.is_initialized():
        return
    gc.collect()
    try:
        _leave()
    except RuntimeError:  # the store already gone (rank 0 died): nothing left to order
        pass


def _collective(what: str, fn, *tensors: torch.Tensor) -> None:
    t0 = time.perf_counter()
    try:
        fn()
    except RuntimeError as e:
        limit = f"{_timeout_s:g} s" if _timeout_s is not None else "the process group's timeout"
        raise RankFailure(f"{what} failed on rank {dist.get_rank()} of {dist.get_world_size()}: another rank most "
                          f"likely died or stalled (collectives wait at most {limit}): {e}") from e
    STATS.seconds += time.perf_counter() - t0
    STATS.calls += 1
    STATS.bytes += sum(t.numel() * t.element_size() for t in tensors)


def all_reduce(tensor: torch.Tensor, op, what: str, group=None) -> torch.Tensor:
    """In-place all-reduce, timed into STATS; a failure raises RankFailure naming `what`."""
    _collective(what, lambda: dist.all_reduce(tensor, op=op, group=group), tensor)
    return tensor
