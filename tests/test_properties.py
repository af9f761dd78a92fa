"""Property-based tests (hypothesis): the ops against the float64 reference on random
layouts, masks, dtypes and offset views; StepPlan on random splits of a step; the config
loader on random bytes and random nested structures (a valid config or a ConfigError,
within bounded time). Derandomized, so CI runs the same examples every time."""

from __future__ import annotations

import json
import math

import torch
from batches import BYTE_MASK_DTYPES, LAYOUTS, VALUE_DTYPES, WEIGHT_MASK_DTYPES, per_prompt, sessions_in
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from reference import ref_reduce, ref_reduce_grad, ref_segment_sum

import lossagg
from lossagg.modes import MODES
from lossagg.testing import check_split_invariance

SETTINGS = settings(max_examples=80, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def op_inputs(draw):
    layout = draw(st.sampled_from(LAYOUTS))
    dtype = draw(st.sampled_from(VALUE_DTYPES))
    mask_dtype = draw(st.sampled_from([*BYTE_MASK_DTYPES, *WEIGHT_MASK_DTYPES]))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    if layout == "padded":
        b, t = draw(st.integers(0, 6)), draw(st.integers(0, 50))
        token_shape, cu = (b, t), None
    else:
        lengths = draw(st.lists(st.one_of(st.integers(0, 5), st.integers(0, 300), st.sampled_from([16383, 16384, 16385])), max_size=8))
        b = len(lengths)
        cu = lossagg.cu_seqlens_from_lengths(torch.tensor(lengths, dtype=torch.int64), dtype=torch.int32 if layout == "packed32" else torch.int64)
        token_shape = (int(cu[-1]),)
    offset = draw(st.integers(0, 7))  # a view starting at an odd element: every alignment phase
    n = math.prod(token_shape)
    base = torch.randn(n + offset, generator=g, dtype=torch.float64)
    keep = torch.rand(n, generator=g) < draw(st.floats(0.0, 1.0))
    base[offset:][~keep] = float("nan")  # masked-out tokens hold NaN: must not leak
    values = base.to(dtype)[offset:].reshape(token_shape)
    if mask_dtype in BYTE_MASK_DTYPES:
        mask = keep.to(mask_dtype).reshape(token_shape)
    else:
        mask = torch.where(keep, 0.25 + torch.rand(n, generator=g, dtype=torch.float64), 0.0).to(mask_dtype).reshape(token_shape)
    denoms = (0.5 + 10 * torch.rand(b, generator=g, dtype=torch.float64)).to(draw(st.sampled_from([torch.float32, torch.float64])))
    return values, mask, cu, denoms


@SETTINGS
@given(op_inputs())
def test_ops_match_the_reference(inputs):
    values, mask, cu, denoms = inputs
    tol = dict(rtol=1e-10, atol=1e-10) if values.dtype == torch.float64 else dict(rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(lossagg.segment_sum(values, mask, cu).double(), ref_segment_sum(values, mask, cu), **tol)
    leaf = values.detach().clone().requires_grad_(True)
    j = lossagg.reduce(leaf, mask, cu_seqlens=cu, sample_denoms=denoms)
    torch.testing.assert_close(j.double(), ref_reduce(values, mask, denoms, cu), **tol)
    j.backward()
    grad_tol = dict(rtol=1e-2, atol=1e-6) if values.dtype in (torch.bfloat16, torch.float16) else dict(rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(leaf.grad.double(), ref_reduce_grad(mask, denoms, cu), **grad_tol)
    assert torch.equal(lossagg.reduce(values, mask, cu_seqlens=cu, sample_denoms=denoms), j.detach())  # bitwise rerun


@st.composite
def steps(draw):
    mode = draw(st.sampled_from(list(MODES)))
    n_groups = draw(st.integers(1, 5))
    n = draw(st.integers(1, 4))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, draw(st.integers(1, 60)), (n_groups * n,), generator=g)
    cu = lossagg.cu_seqlens_from_lengths(lengths, dtype=torch.int64)
    values = torch.randn(int(cu[-1]), generator=g, dtype=torch.float64)
    mask = torch.rand(int(cu[-1]), generator=g) < 0.8
    size = draw(st.integers(1, 3))  # samples per session (docs/modes.md, "Sessions"), nested in the groups
    config = lossagg.LossAggregationConfig(mode=mode, n_samples_per_prompt=per_prompt(mode, n, size), **MODES[mode].example_settings)
    split = (draw(st.integers(1, 4)), draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    groups = torch.arange(n_groups).repeat_interleave(n)
    return config, values, mask, cu, groups, sessions_in(groups, size), split


@SETTINGS
@given(steps())
def test_any_split_of_a_step_gives_j(step):
    config, values, mask, cu, groups, sessions, (micro_batches, dp, cp) = step
    report = check_split_invariance(
        config,
        values,
        mask,
        cu,
        group_index=groups,
        session_index=sessions,
        micro_batches=micro_batches,
        dp_size=dp,
        cp_size=cp,
        rtol=1e-9,
        atol=1e-12,
    )
    assert report.ok, str(report)


settings_keys = st.sampled_from(["mode", "divisor", "calculate_per_token_loss", "n_samples_per_prompt", "global_batch_size", "loss_aggregation"])
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(10**30), 10**30), st.floats(allow_nan=True), st.text(max_size=40), st.sampled_from(list(MODES))
)
nested = st.recursive(
    scalars,
    lambda children: st.one_of(st.lists(children, max_size=4), st.dictionaries(st.one_of(settings_keys, st.text(max_size=10)), children, max_size=5)),
    max_leaves=30,
)


@SETTINGS
@given(st.dictionaries(st.one_of(settings_keys, st.text(max_size=12)), nested, max_size=6))
def test_config_from_random_structures_is_valid_or_a_config_error(data):
    try:
        config = lossagg.LossAggregationConfig.from_dict(data)
    except lossagg.ConfigError as exc:
        assert exc.issues and len(str(exc)) < 20_000
    else:
        assert config.mode in MODES


@SETTINGS
@given(st.binary(max_size=2000), st.sampled_from([".json", ".yaml", ".toml"]))
def test_config_files_of_random_bytes_are_valid_or_a_config_error(tmp_path_factory, raw, ext):
    path = tmp_path_factory.mktemp("fuzz") / f"c{ext}"
    path.write_bytes(raw)
    try:
        lossagg.LossAggregationConfig.from_file(path)
    except lossagg.ConfigError as exc:
        assert str(path) in str(exc)


@SETTINGS
@given(nested)
def test_config_files_of_random_structures_are_valid_or_a_config_error(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("fuzz") / "c.json"
    try:
        text = json.dumps(data, allow_nan=True)
    except (ValueError, OverflowError):
        assume(False)  # not representable as JSON
    path.write_text(text)
    try:
        lossagg.LossAggregationConfig.from_file(path)
    except lossagg.ConfigError as exc:
        assert str(path) in str(exc)
