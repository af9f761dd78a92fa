"""The ops right after a plain ``import lossagg``, in a fresh process.

Training code calls ``torch.ops.lossagg.*`` directly (the README's first example): the fake
kernels must be registered by ``import lossagg`` itself, not by a later touch of
``lossagg.reduce``. Every other test module imports more of lossagg first, so this one runs
its checks in a subprocess that does nothing else before them: ``opcheck`` of every op
(fake tensors, schema, autograd registration) and ``torch.compile(fullgraph=True)`` of the
forward ops (reduce, segment_sum, reduce_terms) with their backward.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import native_ops

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FRESH = textwrap.dedent(
    """
    import sys
    import torch
    import lossagg

    assert "lossagg.step" not in sys.modules and "lossagg.one_pass" not in sys.modules, "the test must start from a plain import"
    ops = torch.ops.lossagg
    v = torch.randn(7, dtype=torch.float64, requires_grad=True)
    m = torch.tensor([1, 1, 0, 1, 1, 1, 0], dtype=torch.bool)
    cu = torch.tensor([0, 3, 3, 7], dtype=torch.int32)
    d = torch.tensor([2.0, 1.0, 4.0], dtype=torch.float64)
    k2 = torch.randn(2, 7, dtype=torch.float64, requires_grad=True)
    padded = torch.randn(3, 4, requires_grad=True)
    padded_mask = torch.rand(3, 4) > 0.3
    calls = {
        "reduce": [(v, m, cu, d), (padded, padded_mask, None, torch.tensor([1.0, 2.0, 3.0]))],
        "segment_sum": [(v, m, cu), (k2, m, cu), (padded, padded_mask, None)],
        "segment_sum_and_count": [(v.detach(), m, cu), (padded.detach(), padded_mask, None)],
        "aggregate": [(v, m, cu, [1, 6], 0.0), (padded, padded_mask, None, [3], 0.0)],
        # prompt_mean's d = P · c(Sg[g(i)]) by the plan's passes (lossagg/step.py's _factor_codes)
        "aggregate_planned": [(v, m, cu, torch.tensor([0, 0, 1]), None, -1, True, False, [2, 5, 0, 0, 0, 9, 0, 1, 0], 0.0)],
        "reduce_backward": [(torch.tensor(1.5, dtype=torch.float64), m, cu, d, torch.float64)],
        "segment_sum_backward": [(torch.randn(3, dtype=torch.float64), m, cu, torch.float32)],
        "token_counts": [(m, cu), (padded_mask, None)],
        "reduce_terms": [
            ([v, k2[0].detach().clone().requires_grad_(True)], m, cu, torch.stack([d, 2 * d]), None, [1.0, -0.5]),
            ([padded, padded.detach() * 2], padded_mask, None, torch.ones(2, 3), torch.tensor([[1.0, -1.0, 0.0]] * 2), [0.5, 2.0]),
        ],
        "reduce_terms_backward": [(torch.tensor(1.5, dtype=torch.float64), m, cu, torch.stack([d, d]), None, [1.0, 3.0], torch.float64)],
        "plan_totals": [(torch.tensor([3, 0, 5]), None, None, -1, False, False, [], True, [1, -2, 0, 1, 0], [0.0])],
        "plan_layout": [(torch.tensor([0, 0, 1]), torch.tensor([4, 5, 6]), 2, True, True, False)],
    }
    for name, arg_sets in calls.items():
        for args in arg_sets:
            torch.library.opcheck(getattr(ops, name).default, args)
        print("opcheck", name)

    def step(values):
        terms = ops.reduce_terms([values, values * 2], m, cu, torch.stack([d, d]), None, [1.0, 0.25])[0]
        return ops.reduce(values, m, cu, d) + ops.segment_sum(values, m, cu).sum() + terms

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    got = compiled(v)
    (g,) = torch.autograd.grad(got, v)
    want = step(v)
    (g_want,) = torch.autograd.grad(want, v)
    assert torch.equal(got, want) and torch.equal(g, g_want), (got, want, g, g_want)
    print("compile ok")
    """
)


def test_every_op_has_its_fake_and_compiles_right_after_a_plain_import():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-c", FRESH], capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    lines = done.stdout.splitlines()
    assert sorted(line for line in lines if line.startswith("opcheck")) == sorted(f"opcheck {name}" for name in native_ops.OPS)
    assert lines[-1] == "compile ok", done.stdout
