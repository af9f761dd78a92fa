"""Batches for the tests, and the dtypes they sweep: one place for every builder of random
inputs (op batches in both layouts, steps of prompt groups, verl's padded loss matrices).

Each builder draws from its own seeded generator unless it says otherwise, so a test that
builds the same batch twice gets the same bits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import lossagg

# ------------------------------------------------------------------------ dtypes
# the values dtypes the ops take
VALUE_DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
# one mask of each kind the op tests sweep: bool, 0/1 integers (one byte, and trainers'
# int64/int32 masks as they are), float32 weights
MASK_DTYPES = [torch.bool, torch.uint8, torch.int64, torch.int32, torch.float32]
# masks of one byte: a token is kept or dropped
BYTE_MASK_DTYPES = [torch.bool, torch.uint8]
# masks whose values are weights, in both float precisions
WEIGHT_MASK_DTYPES = [torch.float32, torch.float64]
LAYOUTS = ["packed32", "packed64", "padded"]


# ---------------------------------------------------------------- op batches
@dataclass
class Batch:
    values: torch.Tensor
    mask: torch.Tensor
    cu_seqlens: torch.Tensor | None
    sample_denoms: torch.Tensor

    @property
    def num_segments(self) -> int:
        return self.sample_denoms.shape[0]


def make_mask(shape, mask_dtype, generator, keep=0.7):
    keep_t = torch.rand(shape, generator=generator) < keep
    if mask_dtype == torch.bool:
        return keep_t
    if not mask_dtype.is_floating_point:  # integer masks as trainers hand them: 0/1
        return keep_t.to(mask_dtype)
    # floating masks carry weights (e.g. truncated importance weights)
    weights = 0.25 + torch.rand(shape, generator=generator)
    return torch.where(keep_t, weights, torch.zeros(())).to(mask_dtype)


def make_batch(
    layout: str,
    *,
    lengths=(5, 0, 17, 1, 64, 33),
    row_len: int = 40,
    dtype=torch.float32,
    mask_dtype=torch.bool,
    num_metrics: int | None = None,
    device="cpu",
    seed: int = 0,
    requires_grad: bool = False,
) -> Batch:
    """A random batch in one of LAYOUTS: values, a mask of ``mask_dtype`` and d[i] in [1, 11)."""
    g = torch.Generator().manual_seed(seed)
    if layout == "padded":
        token_shape = (len(lengths), row_len)
        cu = None
    else:
        offsets = [0]
        for n in lengths:
            offsets.append(offsets[-1] + n)
        token_shape = (offsets[-1],)
        cu = torch.tensor(offsets, dtype=torch.int32 if layout == "packed32" else torch.int64)
    shape = token_shape if num_metrics is None else (num_metrics, *token_shape)
    values = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    mask = make_mask(token_shape, mask_dtype, g)
    denoms = 1.0 + 10.0 * torch.rand(len(lengths), generator=g, dtype=torch.float64)
    batch = Batch(
        values=values.to(device).requires_grad_(requires_grad),
        mask=mask.to(device),
        cu_seqlens=None if cu is None else cu.to(device),
        sample_denoms=denoms.to(torch.float32).to(device),
    )
    return batch


def long_batch(device, dtype=torch.float32, seed=0):
    """Segments longer than one CPU work piece (16384 tokens) and many short ones, so the
    fixed piece split and the cross-piece combine are exercised."""
    lengths = [70_001, 3, 0, 40_000, 129, 16_384, 16_385, 1]
    return make_batch("packed64", lengths=lengths, dtype=dtype, device=device, seed=seed, requires_grad=True)


def many_short_batch(seed=0):
    """40,000 segments of 0..8 tokens: many pieces, split by tokens across threads."""
    lengths = torch.randint(0, 9, (40_000,), generator=torch.Generator().manual_seed(seed)).tolist()
    return make_batch("packed32", lengths=lengths, seed=seed, requires_grad=True)


def every_path_batch(dtype, mask_dtype, seed=0):
    """Lengths hitting every summation path: windows of 8 and 16 tokens (0..16), the short
    loop (17..63), the 16 lanes (64..16384) and several pieces (> 16384); with -0.0 values
    and NaN/inf under the mask."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 17, (3000,), generator=g).tolist() + list(range(17, 70)) + [1000, 16_384, 16_385, 40_000]
    perm = torch.randperm(len(lengths), generator=g).tolist()
    b = make_batch("packed64", lengths=[lengths[i] for i in perm], dtype=dtype, mask_dtype=mask_dtype, seed=seed, requires_grad=False)
    values = b.values.detach().clone()
    values[::97] = -0.0
    values[(b.mask == 0) & (torch.arange(values.shape[0]) % 3 == 0)] = float("nan")
    values[(b.mask == 0) & (torch.arange(values.shape[0]) % 3 == 1)] = float("inf")
    b.values = values.requires_grad_(True)
    return b


def six_token_batch():
    """Two packed samples of 3 tokens (one masked), d = [2, 4]: (values, mask, cu_seqlens,
    sample_denoms). The values come from torch's global generator."""
    values = torch.randn(6)
    mask = torch.tensor([1, 1, 0, 1, 1, 1], dtype=torch.bool)
    cu = torch.tensor([0, 3, 6])
    return values, mask, cu, torch.tensor([2.0, 4.0])


def two_sample_batch(device, n=10):
    """Two packed samples (4 and n - 4 tokens, all kept), int32 offsets, d = [1, 1]:
    (values, mask, cu_seqlens, sample_denoms). The values come from torch's global generator."""
    values = torch.randn(n, device=device)
    mask = torch.ones(n, dtype=torch.bool, device=device)
    cu = torch.tensor([0, 4, n], dtype=torch.int32, device=device)
    denoms = torch.ones(2, device=device)
    return values, mask, cu, denoms


def big_cuda_batch(tokens=3_000_000, samples=300, dtype=torch.bfloat16, seed=0):
    """About ``tokens`` tokens over ``samples`` packed samples on the GPU, one of them empty and
    one of 70,000 tokens (across ~70 tiles); d[i] = 1 + M[i]: (values, mask, cu_seqlens, sample_denoms)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 2 * tokens // samples, (samples,), generator=g)
    lengths[7] = 0
    lengths[8] = 70_000  # one sequence across ~70 tiles
    cu = torch.zeros(samples + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lengths, 0)
    total = int(cu[-1])
    values = torch.randn(total, generator=g).to(dtype)
    mask = torch.rand(total, generator=g) < 0.8
    denoms = 1 + lengths.float()
    return values.cuda(), mask.cuda(), cu.cuda(), denoms.cuda()


# ------------------------------------------------------------------ steps
def random_step(n_groups=6, n=4, seed=0, max_len=40):
    """A packed step of ``n_groups`` prompt groups of ``n`` samples, float32 values, sample 3
    fully masked: (values, mask, cu_seqlens, group_index)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, max_len, (n_groups * n,), generator=g)
    cu = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(lengths, 0)
    total = int(cu[-1])
    values = torch.randn(total, generator=g, dtype=torch.float64).float()
    mask = torch.rand(total, generator=g) < 0.8
    # one fully masked sample
    mask[cu[3] : cu[4]] = False
    group_index = torch.arange(n_groups).repeat_interleave(n)
    return values, mask, cu, group_index


def random_float64_step(seed=0, n_groups=4, n=4, max_len=30):
    """A packed step of ``n_groups`` prompt groups of ``n`` samples, float64 values, sample 3
    empty: (values, mask, cu_seqlens, group_index)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, max_len, (n_groups * n,), generator=g)
    lengths[3] = 0
    cu = lossagg.cu_seqlens_from_lengths(lengths, dtype=torch.int64)
    values = torch.randn(int(cu[-1]), generator=g, dtype=torch.float64)
    mask = torch.rand(int(cu[-1]), generator=g) < 0.8
    return values, mask, cu, torch.arange(n_groups).repeat_interleave(n)


# ----------------------------------------------------------- adapter inputs
def padded_loss_batch(seed, bs=6, length=9, dtype=torch.float64, mask_dtype=torch.float32):
    """verl's inputs: a [bs, length] loss matrix and a right-padded response mask, response 0
    fully masked: (loss_mat, loss_mask)."""
    g = torch.Generator().manual_seed(seed)
    loss = torch.randn(bs, length, generator=g, dtype=torch.float64).to(dtype)
    lengths = torch.randint(0, length + 1, (bs,), generator=g)
    lengths[0] = 0  # one fully masked response
    mask = (torch.arange(length)[None] < lengths[:, None]).to(mask_dtype)
    return loss, mask


def loss_like(mask, seed=0):
    """A float64 per-token loss of the mask's shape."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(mask.shape, generator=g, dtype=torch.float64)


# ------------------------------------------------------- sequence-level objectives
@dataclass
class PolicyBatch:
    """One step of a sequence-level objective (docs/sequence.md), in one layout: per-token
    ``log_prob`` (a float64 leaf that requires grad), ``old_log_prob``, the 0/1 ``mask`` (float64,
    as TRL and verl hand it), ``cu_seqlens`` (None when padded) and per-sample ``advantages``."""

    log_prob: torch.Tensor
    old_log_prob: torch.Tensor
    mask: torch.Tensor
    cu_seqlens: torch.Tensor | None
    advantages: torch.Tensor


def policy_batch(seed=0, layout="padded", lengths=(3, 0, 9, 5, 1, 7, 4, 6), spread=0.45) -> PolicyBatch:
    """Samples of ``lengths`` tokens (sample 1 empty, sample 5 fully masked, a few tokens of
    the others masked), log ratios of about ``±spread`` per sample plus token noise (so that
    clipping happens on both sides at epsilons of 0.2-0.3), advantages of both signs and one 0.
    Padded: rows of ``max(lengths)`` with finite junk after each sample's end; packed: the same
    samples back to back."""
    g = torch.Generator().manual_seed(seed)
    b, width = len(lengths), max(lengths)
    within = torch.arange(width)[None] < torch.tensor(lengths)[:, None]
    mask = within & (torch.rand(b, width, generator=g) < 0.85)
    mask[5] = False
    log_prob = -(0.1 + 2.0 * torch.rand(b, width, generator=g, dtype=torch.float64))
    offsets = spread * (2 * torch.rand(b, 1, generator=g, dtype=torch.float64) - 1)
    old = log_prob - offsets - 0.25 * torch.randn(b, width, generator=g, dtype=torch.float64)
    log_prob = torch.where(within, log_prob, torch.full((), -5.0, dtype=torch.float64))
    old = torch.where(within, old, torch.full((), 3.0, dtype=torch.float64))
    advantages = torch.randn(b, generator=g, dtype=torch.float64)
    advantages[3] = 0.0
    mask = mask.to(torch.float64)
    if layout == "padded":
        return PolicyBatch(log_prob.requires_grad_(True), old, mask, None, advantages)
    pick = within.reshape(-1)
    cu = lossagg.cu_seqlens_from_lengths(torch.tensor(lengths), dtype=torch.int32 if layout == "packed32" else torch.int64)
    return PolicyBatch(
        log_prob.reshape(-1)[pick].clone().requires_grad_(True), old.reshape(-1)[pick].clone(), mask.reshape(-1)[pick].clone(), cu, advantages
    )


# ------------------------------------------------------------------------ sessions
def sessions_in(groups: torch.Tensor, size: int = 2) -> torch.Tensor:
    """Session labels nested in the prompt groups (docs/modes.md, "Sessions"): each run of a group's
    samples, in order, cut into sessions of ``size`` samples (the last may hold fewer); labels
    0, 1, ... in order, so a split of the step into blocks cuts some sessions apart."""
    labels, current, count, last = [], -1, 0, None
    for g in torch.as_tensor(groups).tolist():
        if g != last or count == size:
            current, count = current + 1, 0
        labels.append(current)
        count, last = count + 1, g
    return torch.tensor(labels, dtype=torch.int64)


def per_prompt(mode: str, n: int | None, size: int = 2) -> int | None:
    """The config's ``n_samples_per_prompt`` for a step of groups of ``n`` samples under ``mode``:
    the sessions of a group (:func:`sessions_in`) under a mode with sessions in prompt groups, else ``n``."""
    if n is None or "group_sessions" not in lossagg.MODES[mode].totals:
        return n
    return -(-n // size)


#: The session modes the multi-process engine worlds run: between them they hold every session
#: factor (session_mean: S, K[s(i)]; prompt_session_token_mean: P, Sp[g(i)], c(Ts[s(i)])), so each
#: engine meets each factor; every session mode runs in tests/test_sessions.py,
#: tests/test_sessions_distributed.py and the single-process split checks (checked by
#: tests/test_sessions.py::test_the_engine_worlds_meet_every_session_factor).
ENGINE_SESSION_MODES = ("session_mean", "prompt_session_token_mean")


def engine_modes() -> list[str]:
    """The modes a multi-process engine world runs: every registered mode without sessions, and
    :data:`ENGINE_SESSION_MODES`."""
    return [m for m, spec in lossagg.MODES.items() if not spec.needs_sessions or m in ENGINE_SESSION_MODES]


def function_mode(name: str, denom_formula: str, denoms, reference) -> lossagg.ModeSpec:
    """A test mode whose ``d[i]`` is a function (not a :class:`lossagg.DenomProduct`) reading ``N``."""
    summary, formula = f"test mode: d[i] = {denom_formula}", f"Σ_i Σ_t m·l / ({denom_formula})"
    return lossagg.ModeSpec(name, summary, formula, denom_formula, ("num_samples",), denoms, reference)
