"""Multi-process test worlds (gloo on CPU): spawn the ranks, collect what each reported."""

from __future__ import annotations

import os
import tempfile

import torch.multiprocessing as mp


def report(results_dir: str, rank: int, ran: int, failures: list[str]) -> None:
    """Called by each rank at its end: how many checks it ran and what failed."""
    with open(os.path.join(results_dir, f"rank{rank}.txt"), "w") as f:
        f.write(f"ran {ran}\n" + "\n".join(failures))


def run_world(worker, world: int, args: tuple, tmp_path) -> tuple[list[str], int]:
    """``worker(rank, world, *args, init_file, results_dir)`` on ``world`` processes; (failures, checks run)."""
    mp.spawn(worker, args=(world, *args, tempfile.mktemp(dir=tmp_path), str(tmp_path)), nprocs=world, join=True)
    failures, runs = [], 0
    for rank in range(world):
        head, _, rest = (tmp_path / f"rank{rank}.txt").read_text().partition("\n")
        runs += int(head.split()[1])
        if rest.strip():
            failures.append(rest)
    return failures, runs
