"""The spawn fixture itself: per-rank results come back in rank order, a failing rank fails the run
fast with its traceback while the others are killed rather than left hanging, a collective whose
peer never arrives times out, and a run past its deadline is killed."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from cs336_systems.distributed.launch import RankFailedError, _collective_threads, find_free_port
from cs336_systems.distributed.process_group import shutdown


def _whoami(tag: str) -> dict:
    rank = dist.get_rank()
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total)
    return {
        "rank": rank,
        "world_size": dist.get_world_size(),
        "backend": dist.get_backend(),
        "env": (os.environ["RANK"], os.environ["LOCAL_RANK"], os.environ["WORLD_SIZE"]),
        "sum": total.item(),
        "tag": tag,
        "tensor": torch.full((2,), float(rank)),
    }


def _write_pid(directory: str) -> None:
    Path(directory, f"rank{dist.get_rank()}.pid").write_text(str(os.getpid()))


def _pids(directory: Path) -> list[int]:
    return [int(f.read_text()) for f in sorted(directory.glob("rank*.pid"))]


def _rank1_raises(directory: str) -> None:
    _write_pid(directory)
    dist.barrier()  # both pids are written before rank 1 fails
    if dist.get_rank() == 1:
        raise ValueError("boom from rank 1")
    dist.barrier()  # rank 0 waits for rank 1 here: killed by the launcher (or failing on the lost
    # peer, which the launcher must not report as the cause), never waiting out the timeout
    time.sleep(600)


def _rank0_exits_hard() -> None:
    if dist.get_rank() == 0:
        os._exit(3)
    time.sleep(600)


def _rank1_never_joins() -> None:
    if dist.get_rank() == 1:
        time.sleep(600)
    dist.barrier()  # rank 0: the process group's timeout turns the missing peer into an error


class _Cycle:
    """Holds collective Work handles in a reference cycle: freed only by the cyclic collector."""


def _works_in_a_cycle() -> dict:
    """Waited-on async collectives whose handles sit in a cycle that is garbage when the group is
    destroyed; then the launcher's own teardown, called here to look at the threads after it."""
    holder = _Cycle()
    holder.me = holder
    holder.works = [dist.all_reduce(torch.ones(8), async_op=True) for _ in range(3)]
    for w in holder.works:
        w.wait()
    during = _collective_threads()
    del holder, w  # the function's own references go; the cycle stays, garbage
    shutdown(barrier=True)
    return {"during": during, "after": _collective_threads()}


def _optimizer_then_teardown() -> list[str]:
    """Any torch.optim optimizer imports torch._dynamo; imported after the group exists, it kept the
    group (and gloo's threads) alive past destroy_process_group."""
    opt = torch.optim.AdamW(torch.nn.Linear(2, 2).parameters())
    del opt
    shutdown(barrier=True)
    return _collective_threads()


_KEPT: list = []  # a module global that outlives the function: what the launcher must report


def _keeps_a_work() -> list[str]:
    _KEPT.append(dist.all_reduce(torch.ones(8), async_op=True))
    _KEPT[-1].wait()
    shutdown(barrier=True)
    return _collective_threads()


def _sleeps(directory: str) -> None:
    _write_pid(directory)
    time.sleep(600)


def _pids_alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
            alive.append(pid)
        except ProcessLookupError:
            pass
    return alive


@pytest.mark.distributed
@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [1, 3])
def test_results_come_back_per_rank(run_distributed, world_size: int) -> None:
    results = run_distributed(_whoami, world_size, "hello", backend="gloo", timeout=90)
    assert [r["rank"] for r in results] == list(range(world_size))
    for rank, r in enumerate(results):
        assert r["world_size"] == world_size and r["backend"] == "gloo" and r["tag"] == "hello"
        assert r["env"] == (str(rank), str(rank), str(world_size))
        assert r["sum"] == world_size * (world_size + 1) / 2  # the ranks formed one group
        assert torch.equal(r["tensor"], torch.full((2,), float(rank)))


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_a_raising_rank_fails_fast_with_its_traceback(run_distributed, tmp_path: Path) -> None:
    start = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        run_distributed(_rank1_raises, 2, str(tmp_path), backend="gloo", timeout=90)
    message = str(info.value)
    assert "rank 1 of 2 failed" in message
    assert "ValueError: boom from rank 1" in message and "_rank1_raises" in message  # the traceback
    assert time.monotonic() - start < 60  # not the 90 s timeout: rank 0 was killed, not awaited
    assert len(_pids(tmp_path)) == 2 and not _pids_alive(_pids(tmp_path))


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_a_rank_that_dies_without_traceback(run_distributed) -> None:
    with pytest.raises(RankFailedError, match="rank 0 of 2 failed:\nexited with code 3 and no traceback"):
        run_distributed(_rank0_exits_hard, 2, backend="gloo", timeout=90)


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_a_collective_without_its_peer_times_out(run_distributed) -> None:
    start = time.monotonic()
    with pytest.raises(RankFailedError, match="rank 0 of 2 failed") as info:
        run_distributed(_rank1_never_joins, 2, backend="gloo", timeout=10)
    assert "barrier" in str(info.value).lower() or "timed out" in str(info.value).lower()
    assert time.monotonic() - start < 60


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_the_deadline_kills_a_run_that_never_ends(run_distributed, tmp_path: Path) -> None:
    # The deadline is timeout + startup_grace (default 60 s, for importing torch in the ranks).
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="still running at the deadline; killed"):
        run_distributed(
            _sleeps, 1, str(tmp_path), backend="gloo", timeout=2, startup_grace=20
        )  # 1 rank: no rendezvous; 20 s: importing torch took 3-8 s at a load of 2 per core on 2 cores
    assert 22 <= time.monotonic() - start < 60
    assert _pids(tmp_path) and not _pids_alive(_pids(tmp_path))  # ranks that got going were killed


def test_free_ports_differ_and_bind() -> None:
    ports = {find_free_port() for _ in range(5)}
    assert len(ports) >= 4 and all(1024 < p < 65536 for p in ports)


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_no_gloo_thread_outlives_the_process_group(run_distributed) -> None:
    """A Work handle in a reference cycle kept gloo's device and its loop thread alive past
    destroy_process_group, to be torn down at interpreter exit (where a rank aborted now and then with
    "terminate called without an active exception"). The teardown collects it first."""
    for res in run_distributed(_works_in_a_cycle, 2, backend="gloo", timeout=90):
        assert "gloo_tcp_loop" in res["during"], res
        assert res["after"] == [], res


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_an_optimizer_does_not_pin_the_process_group(run_distributed) -> None:
    assert run_distributed(_optimizer_then_teardown, 2, backend="gloo", timeout=90) == [[], []]


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_a_work_kept_past_the_run_does_not_fail_the_rank(run_distributed) -> None:
    """A Work handle in a module global keeps gloo's threads alive after the group is destroyed; the
    rank leaves without tearing them down (os._exit after its results are written) and the run
    succeeds."""
    assert run_distributed(_keeps_a_work, 2, backend="gloo", timeout=90) == [["gloo_tcp_loop"]] * 2


def test_the_store_is_the_parents_on_a_port_it_holds() -> None:
    """No free-port pick to race: the parent binds port 0 and holds it while the ranks run."""
    import socket

    from cs336_systems.distributed.launch import host_store

    store = host_store(2, 10.0)
    with socket.socket() as s, pytest.raises(OSError):
        s.bind(("127.0.0.1", store.port))
    del store
