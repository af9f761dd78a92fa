"""The test worlds' own contract (tests/worlds.py): a rank's exception reaches the test, and a world that hangs
is killed at its timeout with a failure naming it, not left holding the run."""

from __future__ import annotations

import os
import time

import pytest
import torch.multiprocessing as mp
import worlds


def _sleeper(rank, pid_dir):
    with open(os.path.join(pid_dir, f"{rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(600)


def _raiser(rank):
    if rank == 1:
        raise ValueError("rank 1 gave up")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie not yet reaped is dead
        return f.read().split(") ")[-1][0] != "Z"


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads the ranks' state from /proc")
def test_a_hanging_world_is_killed_at_its_timeout(tmp_path):
    began = time.monotonic()
    with pytest.raises(TimeoutError, match=r"a world of 2 (forked|spawned) processes ran 2 s and was killed"):
        worlds.start(_sleeper, (str(tmp_path),), 2, timeout=2)
    assert time.monotonic() - began < 30
    pids = [int((tmp_path / f"{r}.pid").read_text()) for r in range(2)]
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids), pids


def test_a_ranks_exception_reaches_the_test():
    with pytest.raises(mp.ProcessRaisedException, match="rank 1 gave up"):
        worlds.start(_raiser, (), 2)
