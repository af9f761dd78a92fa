"""Multi-process test worlds (gloo on CPU): start the ranks, collect what each reported.

The ranks are forked from the pytest process (:func:`start`): each inherits its imports (torch, lossagg, the
test module and what it imported), which spawning would pay again in every rank, a few seconds of CPU each; a
world that needs an interpreter of its own (a trainer with its own packages first on ``sys.path``, such as
miles' vendored megatron) asks for ``fresh=True``, which spawns. A world that outlives ``timeout`` is killed and
its test fails, naming the time, rather than holding the run. ``LOSSAGG_WORLDS=spawn`` spawns every world (to
show that nothing a rank inherits by fork decides a test: the same results and coverage either way)."""

from __future__ import annotations

import os
import sys
import tempfile

import torch.multiprocessing as mp


def dp_cp_groups(rank: int, dp: int, cp: int):
    """This rank's place in a DP x CP world of DP-major ranks (rank = dp_rank * cp + cp_rank): (dp_rank, cp_rank,
    its DP group, its CP group). Every rank makes every group, in the same order (new_group is collective)."""
    import torch.distributed as dist

    dp_groups = [dist.new_group([d * cp + c for d in range(dp)]) for c in range(cp)]
    cp_groups = [dist.new_group([d * cp + c for c in range(cp)]) for d in range(dp)]
    dp_rank, cp_rank = divmod(rank, cp)
    return dp_rank, cp_rank, dp_groups[cp_rank], cp_groups[dp_rank]


def join(rank: int, world: int, init_file: str) -> tuple[list[str], int]:
    """A rank's start: one thread, the gloo group of ``world`` ranks; returns its (failures, checks run), empty."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    return [], 0


def crashed(who: str, exc: BaseException) -> str:
    """A rank's failure from the exception being handled: who, the exception and its traceback."""
    import traceback

    return f"{who}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}"


def leave(results_dir: str, rank: int, ran: int, failures: list[str]) -> None:
    """A rank's end: its report (:func:`report`), then it leaves the process group."""
    import torch.distributed as dist

    report(results_dir, rank, ran, failures)
    dist.destroy_process_group()


def report(results_dir: str, rank: int, ran: int, failures: list[str]) -> None:
    """Called by each rank at its end: how many checks it ran and what failed."""
    with open(os.path.join(results_dir, f"rank{rank}.txt"), "w") as f:
        f.write(f"ran {ran}\n" + "\n".join(failures))


#: How long a world may run before it is killed (seconds): LOSSAGG_WORLD_TIMEOUT, default 600.
TIMEOUT = float(os.environ.get("LOSSAGG_WORLD_TIMEOUT", "600"))


def start(worker, args: tuple, nprocs: int, *, fresh: bool = False, timeout: float | None = None) -> None:
    """``worker(rank, *args)`` on ``nprocs`` processes, forked on Linux (spawned when ``fresh``, elsewhere, or once
    this process has initialised CUDA),
    waited for; a rank's exception is raised here (torch.multiprocessing's ProcessRaisedException), and a world
    still running after ``timeout`` seconds (default :data:`TIMEOUT`) is killed and fails the test."""
    import time

    import torch

    # a process that has initialised CUDA cannot hand it to a forked child: spawn there (a GPU machine's suite)
    forkable = hasattr(os, "fork") and sys.platform.startswith("linux") and not torch.cuda.is_initialized()
    method = "fork" if forkable and not fresh and os.environ.get("LOSSAGG_WORLDS") != "spawn" else "spawn"
    context = mp.start_processes(worker, args=args, nprocs=nprocs, join=False, start_method=method)
    deadline = time.monotonic() + (TIMEOUT if timeout is None else timeout)
    while not context.join(timeout=max(0.0, min(5.0, deadline - time.monotonic()))):
        if time.monotonic() >= deadline:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
                process.join(5)
            raise TimeoutError(f"a world of {nprocs} {method}ed processes ran {TIMEOUT if timeout is None else timeout:.0f} s and was killed")


def run_world(worker, world: int, args: tuple, tmp_path, *, fresh: bool = False) -> tuple[list[str], int]:
    """``worker(rank, world, *args, init_file, results_dir)`` on ``world`` processes (:func:`start`); (failures,
    checks run)."""
    start(worker, (world, *args, tempfile.mktemp(dir=tmp_path), str(tmp_path)), world, fresh=fresh)
    failures, runs = [], 0
    for rank in range(world):
        head, _, rest = (tmp_path / f"rank{rank}.txt").read_text().partition("\n")
        runs += int(head.split()[1])
        if rest.strip():
            failures.append(rest)
    return failures, runs
