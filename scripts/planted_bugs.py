"""Plant known bugs, one at a time, in a scratch copy of the tree and run the tests that must catch each.

Each adapter has two bugs planted in its own code (a gradient scale off by the DP size; two terms'
denominators swapped) and each built-in mode one in its factors (a factor of its ``d[i]`` replaced):
the tests of that adapter, or of the modes, must fail on it. A refactor shows it lost no coverage by
running this before and after (``make planted-bugs``; CI's full tier runs it too).

    python scripts/planted_bugs.py            # every bug
    python scripts/planted_bugs.py verl trl   # the bugs of some adapters (or "modes")
    python scripts/planted_bugs.py --list

The scratch copy is the tracked tree (``git ls-files``) plus the built native library, in a temporary
folder; the tests run there with it first on ``sys.path`` and the peers of ``build/peers`` linked in.
Exit status 1 when a bug is not caught or its code is no longer where the script plants it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass(frozen=True)
class Bug:
    group: str  # the adapter (or "modes") whose tests must catch it
    name: str
    path: str  # the file it is planted in
    old: str  # the code replaced (must occur exactly once)
    new: str
    tests: tuple[str, ...]  # pytest node ids or files that must fail


def _swap(a: str, b: str) -> str:
    return f'{{"{a}": "{b}", "{b}": "{a}"}}.get(name, name)'


BUGS = (
    # verl: the function (agg_loss) and the trainer's losses
    Bug(
        "verl",
        "agg_loss forgets DDP's average over the DP ranks",
        "lossagg/integrations/verl.py",
        'gradient_scale("mean", dp_size=dp_size)',
        'gradient_scale("mean", dp_size=1)',
        ("tests/test_verl_agg_loss.py",),
    ),
    Bug(
        "verl",
        "the trainer's terms forget the DP size",
        "lossagg/integrations/verl_trainer.py",
        'return plan.loss(values, mb, terms=name, coefficients=False) * gradient_scale("mean", dp_size=dp_size)',
        'return plan.loss(values, mb, terms=name, coefficients=False) * gradient_scale("mean", dp_size=1)',
        ("tests/test_verl_trainer.py",),
    ),
    Bug(
        "verl",
        "the trainer's entropy and KL denominators swapped",
        "lossagg/integrations/verl_trainer.py",
        "return plan.loss(values, mb, terms=name, coefficients=False)",
        f"name = {_swap('entropy', 'kl')} if {{'entropy', 'kl'}} <= set(plan.term_denoms) else name\n"
        "    return plan.loss(values, mb, terms=name, coefficients=False)",
        ("tests/test_verl_trainer.py",),
    ),
    Bug(
        "verl",
        "the driver plans the whole batch as one step, not each PPO mini-batch",
        "lossagg/integrations/verl_trainer.py",
        "return (torch.arange(n) % (n // dp)) // (m // dp)",
        "return torch.zeros(n, dtype=torch.int64)",
        ("tests/test_verl_trainer.py",),
    ),
    Bug(
        "verl",
        "the carried denominators read in the other terms' order",
        "lossagg/integrations/verl_trainer.py",
        "{name: denoms[:, k] for k, name in enumerate(names)}",
        "{name: denoms[:, len(names) - 1 - k] for k, name in enumerate(names)}",
        ("tests/test_verl_trainer.py",),
    ),
    # TRL
    Bug(
        "trl",
        "the loss forgets DDP's average over the processes",
        "lossagg/integrations/trl.py",
        'scale = gradient_scale("mean", dp_size=self.accelerator.num_processes)',
        'scale = gradient_scale("mean", dp_size=1)',
        ("tests/test_trl_multiprocess.py",),
    ),
    Bug(
        "trl",
        "the entropy bonus reduced on the PG term's denominators",
        "lossagg/integrations/trl.py",
        'plan.loss(entropies, mb, terms="entropy", coefficients=False)',
        'plan.loss(entropies, mb, terms="pg", coefficients=False)',
        ("tests/test_trl_trainer.py", "tests/test_trl_multiprocess.py"),
    ),
    # Megatron-style loss function
    Bug(
        "megatron",
        "the loss forgets Megatron's DP factor",
        "lossagg/integrations/megatron.py",
        'scale = gradient_scale("megatron", dp_size=dp_size, cp_size=cp_size, num_micro_batches=num_micro_batches)',
        'scale = gradient_scale("megatron", dp_size=1, cp_size=cp_size, num_micro_batches=num_micro_batches)',
        ("tests/test_megatron_engine.py",),
    ),
    Bug(
        "megatron",
        "two terms' values swapped (each reduced on the other's denominators)",
        "lossagg/integrations/megatron.py",
        "contribution, parts = plan.loss(output_tensor, mb, parts=True)",
        "swapped = dict(zip(output_tensor, reversed(list(output_tensor.values())))) if isinstance(output_tensor, Mapping) else output_tensor\n"
        "        contribution, parts = plan.loss(swapped, mb, parts=True)",
        ("tests/test_megatron_loss_func.py", "tests/test_megatron_engine.py"),
    ),
    Bug(
        "megatron",
        "keep= ignored (the filter inside the loss never applied)",
        "lossagg/integrations/megatron.py",
        "final_mask = keep(output_tensor, loss_mask)",
        "keep(output_tensor, loss_mask)",
        ("tests/test_megatron_loss_func.py", "tests/test_megatron_engine.py"),
    ),
    # miles and slime: their shared runtime and each one's step
    Bug(
        "miles",
        "miles' outer divisor off by the DP size",
        "lossagg/integrations/miles.py",
        "scale = int(counts.clamp(min=1).sum()) if per_token else gbs",
        "scale = int(counts.clamp(min=1).sum()) if per_token else gbs * dp.size",
        ("tests/test_miles_train.py",),
    ),
    Bug(
        "miles",
        "miles' kept-token steps never rescaled after the last micro-batch",
        "lossagg/integrations/miles.py",
        "        done.apply_(chunk)",
        "        pass",
        ("tests/test_miles_train.py",),
    ),
    Bug(
        "slime",
        "slime's outer divisor off by the DP size",
        "lossagg/integrations/slime.py",
        "scales.append(sum(max(table[p][_COUNT], 1) for p in rows) if per_token else gbs)",
        "scales.append(sum(max(table[p][_COUNT], 1) for p in rows) if per_token else gbs * max(torch.distributed.get_world_size(), 1))",
        ("tests/test_slime_train.py",),
    ),
    Bug(
        "seed",
        "the seed reducer's entropy and KL denominators swapped",
        "lossagg/integrations/seed.py",
        "return plan.loss(x, mb, terms=None if plan is self.metric_plan else name, coefficients=False) * self.scale",
        f"swapped = {_swap('entropy', 'kl')} if {{'entropy', 'kl'}} <= set(self.names) else name\n"
        "            return plan.loss(x, mb, terms=None if plan is self.metric_plan else swapped, coefficients=False) * self.scale",
        ("tests/test_miles_train.py", "tests/test_slime_train.py"),
    ),
    Bug(
        "slime",
        "slime's schedule drops its entropy call when entropy_coef is 0",
        "lossagg/integrations/slime.py",
        "entropy_always=True",
        "entropy_always=False",
        ("tests/test_slime_train.py",),
    ),
    # SkyRL (advantage scaling) and the token weights it takes
    Bug(
        "skyrl",
        "token weights forget the engine's DP factor",
        "lossagg/step.py",
        "scale=gradient_scale(convention, dp_size=dp_size, cp_size=cp_size, num_micro_batches=num_micro_batches),",
        "scale=gradient_scale(convention, dp_size=1, cp_size=cp_size, num_micro_batches=num_micro_batches),",
        ("tests/test_skyrl_advantages.py", "tests/test_token_weights.py"),
    ),
    Bug(
        "skyrl",
        "the trainer's advantages scaled as if the workers averaged over the DP ranks",
        "lossagg/integrations/skyrl.py",
        'convention="sum", dtype=advantages.dtype)',
        'convention="mean", dp_size=2, dtype=advantages.dtype)',
        ("tests/test_skyrl_trainer.py",),
    ),
    # OpenRLHF (its actor trainer's own training_step)
    Bug(
        "openrlhf",
        "the policy loss's weights scaled as if DeepSpeed did not average over the DP ranks",
        "lossagg/integrations/openrlhf.py",
        'convention="megatron", dp_size=dp, num_micro_batches=gas)',
        'convention="megatron", dp_size=1, num_micro_batches=gas)',
        ("tests/test_openrlhf_trainer.py",),
    ),
    Bug(
        "openrlhf",
        "KL and entropy totals without DeepSpeed's division by the micro-batches",
        "lossagg/integrations/openrlhf.py",
        'totals = {"dp_size": dp * gas, "batch_num_tokens": d, **per_sample}',
        'totals = {"dp_size": dp, "batch_num_tokens": d, **per_sample}',
        ("tests/test_openrlhf_trainer.py",),
    ),
    # AReaL (its engine's all-reduced loss weight)
    Bug(
        "areal",
        "the engine's loss weight taken on this DP rank alone (W without its all-reduce)",
        "lossagg/integrations/areal.py",
        "        dist.all_reduce(total, group=group)\n",
        "",
        ("tests/test_areal_trainer.py",),
    ),
    # the modes: one factor of each built-in mode's d[i] replaced
    *(
        Bug(
            "modes", f"{mode}: {old} read as {new}", "lossagg/modes.py", f"denoms=DenomProduct({product}),", f"denoms=DenomProduct({mutated}),", tests
        )
        for mode, product, mutated, old, new, tests in (
            ("sample_mean", '"N", "c(M[i])"', '"N", "c(T)"', "c(M[i])", "c(T)", ("tests/test_modes.py",)),
            ("prompt_mean", '"P", "c(Sg[g(i)])"', '"N", "c(Sg[g(i)])"', "P", "N", ("tests/test_modes.py",)),
            ("token_mean", '"c(T)"', '"c(L_max)"', "c(T)", "c(L_max)", ("tests/test_modes.py",)),
            ("constant", '"N", "L"', '"c(T)", "L"', "N", "c(T)", ("tests/test_modes.py",)),
            ("max_length", '"N", "c(L_max)"', '"N", "c(T)"', "c(L_max)", "c(T)", ("tests/test_modes.py",)),
            ("session_mean", '"S", "K[s(i)]", "c(M[i])"', '"S", "c(M[i])"', "K[s(i)]", "1", ("tests/test_sessions.py",)),
            ("session_token_mean", '"S", "c(Ts[s(i)])"', '"N", "c(Ts[s(i)])"', "S", "N", ("tests/test_sessions.py",)),
            (
                "prompt_session_mean",
                '"P", "Sp[g(i)]", "K[s(i)]", "c(M[i])"',
                '"P", "K[s(i)]", "c(M[i])"',
                "Sp[g(i)]",
                "1",
                ("tests/test_sessions.py",),
            ),
            (
                "prompt_session_token_mean",
                '"P", "Sp[g(i)]", "c(Ts[s(i)])"',
                '"S", "c(Ts[s(i)])"',
                "P · Sp[g(i)]",
                "S",
                ("tests/test_sessions.py",),
            ),
        )
    ),
)


def _scratch() -> str:
    """The tracked tree, the native library and the peers' folder, copied (linked) into a temporary folder."""
    where = tempfile.mkdtemp(prefix="lossagg-planted-")
    # the tracked files and the new ones not yet committed (not those git ignores)
    listed = ["git", "ls-files", "--cached", "--others", "--exclude-standard"]
    files = subprocess.run(listed, cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    for f in files:
        src = os.path.join(ROOT, f)
        if os.path.isfile(src):
            os.makedirs(os.path.dirname(os.path.join(where, f)), exist_ok=True)
            shutil.copy2(src, os.path.join(where, f))
    for f in ("lossagg/liblossagg_ops.so", "lossagg/_build_info.py"):
        shutil.copy2(os.path.join(ROOT, f), os.path.join(where, f))
    peers = os.path.join(ROOT, "build", "peers")
    if os.path.isdir(peers):
        os.makedirs(os.path.join(where, "build"), exist_ok=True)
        os.symlink(os.path.realpath(peers), os.path.join(where, "build", "peers"))
    return where


def run(bug: Bug, where: str) -> tuple[str, float]:
    """Plant ``bug`` in the scratch copy, run its tests, restore the file: 'caught', 'MISSED', 'ERROR' or 'STALE'."""
    path = os.path.join(where, bug.path)
    if not os.path.isfile(path):
        return "STALE", 0.0
    text = open(path, encoding="utf-8").read()
    if text.count(bug.old) != 1:
        return "STALE", 0.0
    with open(path, "w", encoding="utf-8") as f:
        f.write(text.replace(bug.old, bug.new))
    env = {**os.environ, "PYTHONPATH": where, "PYTHONDONTWRITEBYTECODE": "1"}
    start = time.monotonic()
    try:
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *bug.tests],
            cwd=where,
            env=env,
            capture_output=True,
            text=True,
        )
    finally:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    seconds = time.monotonic() - start
    tail = done.stdout.strip().splitlines()[-1:] or [""]
    if done.returncode == 1:
        return "caught", seconds
    if done.returncode not in (0, 5):  # pytest could not run the tests: the bug is neither caught nor missed
        why = (done.stderr.strip().splitlines() or done.stdout.strip().splitlines() or [""])[-1]
        return f"ERROR (pytest exit {done.returncode}: {why})", seconds
    return f"MISSED (pytest exit {done.returncode}: {tail[0]})", seconds


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "groups", nargs="*", help="adapters (verl, trl, megatron, miles, slime, seed, skyrl, openrlhf, areal) or 'modes' (default: all)"
    )
    parser.add_argument("--list", action="store_true", help="list the bugs and exit")
    args = parser.parse_args(argv)
    bugs = [b for b in BUGS if not args.groups or b.group in args.groups]
    if args.list:
        for b in bugs:
            print(f"{b.group:9} {b.name}  [{b.path}; {' '.join(b.tests)}]")
        return 0
    where = _scratch()
    failed = 0
    try:
        for b in bugs:
            outcome, seconds = run(b, where)
            failed += outcome != "caught"
            print(f"planted-bugs: {b.group:9} {outcome:7} {seconds:6.1f} s  {b.name}", flush=True)
    finally:
        shutil.rmtree(where, ignore_errors=True)
    print(f"planted-bugs: {len(bugs) - failed} of {len(bugs)} caught")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
