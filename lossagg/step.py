"""Step planning across micro-batches and data-parallel (DP) ranks (SPEC §4).

A :class:`StepPlan` is built once per optimizer step on each rank from the rollout token
counts ``M[i]`` of all of this rank's samples. With a DP process group it issues exactly
one all-reduce (float64) to learn the step-global ``N``, ``T`` and, for modes with prompt
groups, the group sizes and token sums; then it hands each micro-batch its global
denominators ``d[i]`` (``sample_denoms``). A micro-batch's contribution
``reduce(l, m, sample_denoms=d)`` summed over every micro-batch and rank is the step
scalar J, so gradients do not depend on the split.

CP ranks of one DP rank hold the same samples (different tokens): pass the DP group
only, and token counts from the full (unsharded) rollout masks (see
:mod:`lossagg.context_parallel`).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Mapping, Sequence

import torch

from lossagg.config import LossAggregationConfig
from lossagg.denominators import check_group_index, check_group_sizes, check_token_counts, denoms_from_totals, group_totals
from lossagg.layout import token_counts as _token_counts
from lossagg.modes import METRIC_MODE, StepTotals, mode_spec
from lossagg.ops import reduce, segment_sum

GRADIENT_CONVENTIONS = ("sum", "mean", "micro_batch_mean", "megatron")

Samples = slice | Sequence[int] | torch.Tensor


class StepPlan:
    """Global per-sample denominators ``sample_denoms`` (``d[i]``) of one optimizer step, for this rank's samples.

    Args:
        config: the aggregation config.
        token_counts: ``[n_local]`` rollout token counts ``M[i]`` of this rank's samples
            (all its micro-batches), from the full rollout masks.
        group_index: ``[n_local]`` prompt-group index of each sample; required by modes
            with prompt groups. With a process group the labels must mean the same on
            every rank and lie in ``[0, num_group_labels)``, where ``num_group_labels`` is
            given or ``global_batch_size // n_samples_per_prompt``.
        process_group: the DP group (``torch.distributed``); None for one process.
        num_group_labels: how many group labels the step's ``group_index`` can take
            (with a process group). The groups actually present, ``P``, are counted from
            the data: ``plan.totals.num_groups``.
    """

    def __init__(
        self,
        config: LossAggregationConfig,
        token_counts: torch.Tensor,
        *,
        group_index: torch.Tensor | None = None,
        process_group=None,
        num_group_labels: int | None = None,
        num_groups: int | None = None,
        _counts_checked: bool = False,
    ):
        if num_groups is not None:
            warnings.warn("StepPlan(num_groups=) is renamed num_group_labels=", DeprecationWarning, stacklevel=2)
            num_group_labels = num_groups if num_group_labels is None else num_group_labels
        if num_group_labels is not None and (isinstance(num_group_labels, bool) or not isinstance(num_group_labels, int) or num_group_labels < 1):
            raise ValueError(f"num_group_labels must be an integer >= 1, got {num_group_labels!r}")
        if isinstance(config, Mapping):
            config = LossAggregationConfig.from_dict(config)
        if not isinstance(config, LossAggregationConfig):
            raise TypeError(f"config must be a LossAggregationConfig (or a mapping of its settings), got {type(config).__name__}")
        self.config = config
        # counts from lossagg.token_counts are exact int64 >= 0: not checked again
        self.token_counts = token_counts.to(torch.float64) if _counts_checked else check_token_counts(token_counts)
        self.device = self.token_counts.device
        spec = mode_spec(config.mode)

        labels, dense = (None, None)
        if spec.needs_groups:
            labels, dense = self._group_labels(group_index, process_group, num_group_labels)
        if process_group is None and labels is None:  # one process, no groups: N and T are local
            self.totals, group_token_sums = StepTotals(self.token_counts.shape[0], 0, float(self.token_counts.sum())), None
        else:
            buf = self._local_totals(dense, 0 if labels is None else labels.numel())
            if process_group is not None:
                import torch.distributed as dist

                dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=process_group)
            self.totals, group_token_sums = self._read_totals(buf, labels, dense)
        self.sample_denoms = denoms_from_totals(
            config.mode, self.token_counts, self.totals, group_token_sums=group_token_sums, divisor=config.divisor
        )

    @functools.cached_property
    def metric_denoms(self) -> torch.Tensor:
        """``d[i]`` of the default reducer (sample_mean), for metrics other than the PG loss."""
        return denoms_from_totals(METRIC_MODE, self.token_counts, self.totals)

    @classmethod
    def from_mask(
        cls,
        config: LossAggregationConfig,
        rollout_mask: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
        **kwargs,
    ) -> StepPlan:
        """The plan of this rank's samples given their rollout mask (token counts are counted from it)."""
        return cls(config, _token_counts(rollout_mask, cu_seqlens), _counts_checked=True, **kwargs)

    @classmethod
    def from_totals(
        cls,
        config: LossAggregationConfig,
        token_counts: torch.Tensor,
        *,
        num_samples: int,
        total_tokens: float | None = None,
        num_groups: int | None = None,
        group_token_sums: torch.Tensor | None = None,
    ) -> StepPlan:
        """The plan of this rank's samples from step totals a trainer already has (no collective).

        ``num_samples`` is ``N`` (verl's ``global_batch_size``), ``total_tokens`` is ``T``
        (verl's ``batch_num_tokens``, TRL's ``num_items_in_batch``), ``num_groups`` is ``P``
        and ``group_token_sums`` is ``Sg[g(i)]`` of each local sample; a mode needs only the
        totals its ``d[i]`` is made of (``lossagg.MODES[mode]``). ``token_counts`` are this
        rank's ``M[i]``.
        """
        if isinstance(config, Mapping):
            config = LossAggregationConfig.from_dict(config)
        spec = mode_spec(config.mode)
        counts = check_token_counts(token_counts)
        if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < counts.shape[0]:
            raise ValueError(f"num_samples must be an integer >= the {counts.shape[0]} local sample(s), got {num_samples!r}")
        if total_tokens is None:
            if spec.name == "token_mean":
                raise ValueError("total_tokens (T, the step's rollout tokens; TRL's num_items_in_batch) is required under mode=token_mean")
            total_tokens = float(counts.sum())
        total = float(total_tokens)
        if not (total >= 0 and total != float("inf")):
            raise ValueError(f"total_tokens must be a finite number >= 0, got {total_tokens!r}")
        sums = None
        if spec.needs_groups:
            if num_groups is None or group_token_sums is None:
                raise ValueError(f"mode={spec.name} needs num_groups (P) and group_token_sums (Sg[g(i)] of each local sample)")
            if isinstance(num_groups, bool) or not isinstance(num_groups, int) or num_groups < 1:
                raise ValueError(f"num_groups must be an integer >= 1, got {num_groups!r}")
            sums = check_token_counts(group_token_sums)
            if sums.shape != counts.shape:
                raise ValueError(f"group_token_sums must have one entry per local sample ({counts.shape[0]}), got shape {tuple(sums.shape)}")
        plan = cls.__new__(cls)
        plan.config = config
        plan.token_counts = counts
        plan.device = counts.device
        plan.totals = StepTotals(num_samples=num_samples, num_groups=num_groups or 0, total_tokens=total)
        plan.sample_denoms = denoms_from_totals(config.mode, counts, plan.totals, group_token_sums=sums, divisor=config.divisor)
        return plan

    # ------------------------------------------------------------ construction
    def _group_labels(self, group_index, process_group, num_group_labels) -> tuple[torch.Tensor, torch.Tensor]:
        """(labels, dense index of each sample's label). Distributed: global labels 0..G-1."""
        group_index = check_group_index(group_index, self.token_counts.shape[0], self.device)
        if process_group is None:
            labels, dense = torch.unique(group_index, return_inverse=True)
            return labels, dense
        g = num_group_labels
        if g is None and self.config.global_batch_size is not None and self.config.n_samples_per_prompt is not None:
            g = self.config.global_batch_size // self.config.n_samples_per_prompt
        if g is None:
            raise ValueError(
                "with a process group, prompt_mean needs the number of group labels in the step: set global_batch_size and "
                "n_samples_per_prompt in the config or pass num_group_labels"
            )
        if group_index.numel() and (group_index.min() < 0 or group_index.max() >= g):
            raise ValueError(
                f"group_index must lie in [0, {g}) (global prompt index within the step), "
                f"got values in [{int(group_index.min())}, {int(group_index.max())}]"
            )
        return torch.arange(g, device=self.device), group_index.long()

    def _local_totals(self, dense: torch.Tensor | None, num_labels: int) -> torch.Tensor:
        """This rank's share, in one float64 buffer: [N, T, group sizes (G), group token sums (G)]."""
        buf = torch.zeros(2 + 2 * num_labels, dtype=torch.float64, device=self.device)
        buf[0] = self.token_counts.shape[0]
        buf[1] = self.token_counts.sum()
        if dense is not None:
            sizes, sums = group_totals(self.token_counts, dense, num_labels)
            buf[2 : 2 + num_labels] = sizes
            buf[2 + num_labels :] = sums
        return buf

    def _read_totals(self, buf: torch.Tensor, labels, dense) -> tuple[StepTotals, torch.Tensor | None]:
        """Step totals from the (reduced) buffer, and ``Sg[g(i)]`` of each local sample."""
        num_groups, group_token_sums = 0, None
        if labels is not None:
            g = labels.numel()
            sizes = buf[2 : 2 + g]
            check_group_sizes(labels, sizes.long(), self.config.n_samples_per_prompt)
            num_groups = int((sizes > 0).sum().item())
            group_token_sums = buf[2 + g :][dense]
        totals = StepTotals(num_samples=int(round(buf[0].item())), num_groups=num_groups, total_tokens=float(buf[1].item()))
        return totals, group_token_sums

    # ------------------------------------------------------------------- use
    def sample_denoms_for(self, samples: Samples, *, dtype=torch.float32, device=None) -> torch.Tensor:
        """``sample_denoms`` of a micro-batch, given its samples' positions among this rank's samples."""
        d = self.sample_denoms[self._positions(samples)]
        return d.to(dtype=dtype, device=device or self.device)

    def _positions(self, samples: Samples) -> torch.Tensor:
        """Positions among this rank's samples: integers in [0, n_local), a slice, or a bool selection of length n_local."""
        n = self.token_counts.shape[0]
        if isinstance(samples, slice):
            return torch.arange(n, device=self.device)[samples]
        if isinstance(samples, (int, bool)) or (isinstance(samples, torch.Tensor) and samples.dim() == 0):
            raise TypeError("samples must be a 1-D selection of this rank's samples (integer positions, a slice or a bool mask), got a scalar")
        try:
            pos = samples if isinstance(samples, torch.Tensor) else torch.as_tensor(samples)
        except (TypeError, ValueError, RuntimeError):
            raise TypeError(f"samples must be integer positions, a slice or a bool selection, got {type(samples).__name__}") from None
        if pos.dim() != 1:
            raise ValueError(f"samples must be 1-D, got shape {tuple(pos.shape)}")
        if pos.dtype == torch.bool:
            if pos.shape[0] != n:
                raise ValueError(f"samples as a bool selection must have one entry per sample of this rank ({n}), got {pos.shape[0]}")
            return torch.nonzero(pos).flatten().to(self.device)
        if pos.is_floating_point() or pos.is_complex():
            raise TypeError(f"samples must hold integer positions, got dtype {pos.dtype}")
        if pos.numel() and pos.device.type == "cpu":  # positions on an accelerator are not read back (no host sync)
            lo, hi = int(pos.min()), int(pos.max())
            if lo < 0 or hi >= n:
                raise ValueError(f"samples must be positions in [0, {n}) among this rank's samples, got values in [{lo}, {hi}]")
        return pos.to(device=self.device, dtype=torch.long)

    def _micro_batch_denoms(self, samples: Samples, mask: torch.Tensor, cu_seqlens, device) -> torch.Tensor:
        d = self.sample_denoms_for(samples, dtype=torch.float64, device=device)
        b = (cu_seqlens.shape[0] - 1 if cu_seqlens.dim() == 1 else -1) if isinstance(cu_seqlens, torch.Tensor) else mask.shape[0]
        if b >= 0 and d.shape[0] != b:
            layout = "cu_seqlens has" if cu_seqlens is not None else "the padded mask has"
            raise ValueError(f"samples selects {d.shape[0]} sample(s) but {layout} {b}: one position per sample of the micro-batch")
        return d

    def denoms(self, samples: Samples, *, dtype=torch.float32, device=None) -> torch.Tensor:
        """Deprecated name of :meth:`sample_denoms_for`."""
        warnings.warn("StepPlan.denoms() is renamed StepPlan.sample_denoms_for()", DeprecationWarning, stacklevel=2)
        return self.sample_denoms_for(samples, dtype=dtype, device=device)

    def loss(
        self,
        per_token_loss: torch.Tensor,
        mask: torch.Tensor,
        samples: Samples,
        cu_seqlens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """This micro-batch's contribution to J (on this CP rank's tokens, if sharded)."""
        d = self._micro_batch_denoms(samples, mask, cu_seqlens, per_token_loss.device)
        return reduce(per_token_loss, mask, cu_seqlens=cu_seqlens, sample_denoms=d)

    def metrics(
        self,
        metrics: dict[str, torch.Tensor],
        mask: torch.Tensor,
        samples: Samples,
        cu_seqlens: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """Contributions of several per-token metrics under the default (sample_mean) reducer.

        One native segment_sum launch over the stacked ``[K, tokens]`` metrics, whatever
        the PG mode. Sum the returned values over micro-batches (and all-reduce over ranks)
        for the step-level value of each metric.
        """
        names = list(metrics)
        if not names:
            return {}
        for k in names:
            if not isinstance(metrics[k], torch.Tensor) or tuple(metrics[k].shape) != tuple(mask.shape):
                got = tuple(metrics[k].shape) if isinstance(metrics[k], torch.Tensor) else type(metrics[k]).__name__
                raise ValueError(f"metric {k!r} must have the token shape of mask {tuple(mask.shape)}, got {got}")
        stacked = torch.stack([metrics[k].detach() for k in names])
        sums = segment_sum(stacked, mask, cu_seqlens)
        positions = self._positions(samples)
        if positions.shape[0] != sums.shape[-1]:
            raise ValueError(f"samples selects {positions.shape[0]} sample(s) but the micro-batch holds {sums.shape[-1]}")
        d = self.metric_denoms[positions].to(sums.device, torch.float64)
        contrib = (sums.to(torch.float64) / d).sum(-1)
        return {k: contrib[i] for i, k in enumerate(names)}


def gradient_scale(convention: str, *, dp_size: int = 1, cp_size: int = 1, num_micro_batches: int = 1) -> float:
    """Factor to multiply each contribution by so the final gradient is dJ/dθ.

    * ``sum``: gradients are summed over micro-batches and ranks -> 1.
    * ``mean``: DDP/FSDP average gradients over the DP×CP world -> ``dp_size * cp_size``.
    * ``micro_batch_mean``: the trainer divides each micro-batch loss by the number of
      micro-batches -> ``num_micro_batches``.
    * ``megatron``: Megatron-Core without per-token loss (a loss function returning two
      values): its schedule multiplies each micro-batch loss by the CP size and divides it
      by the number of micro-batches, and its DDP averages gradients over DP×CP; the CP
      factors cancel -> ``num_micro_batches * dp_size`` (``cp_size`` is accepted and
      checked, and changes nothing). Read from megatron-core 0.19.2
      (``pipeline_parallel/schedules.py``, ``distributed/distributed_data_parallel.py``) and
      tested against it (tests/test_engine_megatron.py).
    """
    for name, v in (("dp_size", dp_size), ("cp_size", cp_size), ("num_micro_batches", num_micro_batches)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
    if convention == "sum":
        return 1.0
    if convention == "mean":
        return float(dp_size * cp_size)
    if convention == "micro_batch_mean":
        return float(num_micro_batches)
    if convention == "megatron":
        return float(num_micro_batches * dp_size)
    raise ValueError(f"convention must be one of {', '.join(GRADIENT_CONVENTIONS)}, got {convention!r}")


# ------------------------------------------------------ deprecated whole-step helpers
def sample_denoms(mode, token_counts, *, group_index=None, n_samples_per_prompt=None, divisor=None) -> torch.Tensor:
    """Deprecated: ``StepPlan(config, token_counts, group_index=...).sample_denoms``."""
    warnings.warn(
        "lossagg.sample_denoms(mode, ...) is deprecated: use StepPlan(config, token_counts, group_index=...).sample_denoms",
        DeprecationWarning,
        stacklevel=2,
    )
    config = LossAggregationConfig(mode=getattr(mode, "value", mode), n_samples_per_prompt=n_samples_per_prompt, divisor=divisor)
    return StepPlan(config, token_counts, group_index=group_index).sample_denoms


def step_denoms(config, rollout_mask, cu_seqlens=None, group_index=None) -> torch.Tensor:
    """Deprecated: ``StepPlan.from_mask(config, rollout_mask, cu_seqlens, group_index=...).sample_denoms``."""
    warnings.warn(
        "lossagg.step_denoms() is deprecated: use StepPlan.from_mask(config, rollout_mask, cu_seqlens, group_index=...).sample_denoms",
        DeprecationWarning,
        stacklevel=2,
    )
    return StepPlan.from_mask(config, rollout_mask, cu_seqlens, group_index=group_index).sample_denoms
