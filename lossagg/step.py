"""Step planning across micro-batches, data-parallel (DP) and context-parallel (CP) ranks (SPEC §4).

A :class:`StepPlan` is built once per optimizer step on each rank from the rollout token
counts ``M[i]`` of all of this rank's samples. With a DP process group it issues exactly
one all-reduce (float64) to learn the step-global ``N``, ``T`` and, for prompt_mean, the
group sizes and token sums; then it hands each micro-batch its global denominators
``d[i]``. A micro-batch's contribution ``reduce(l, m, d)`` summed over every micro-batch
and rank is the step scalar J, so gradients do not depend on the split.

CP ranks of one DP rank hold the same samples (different tokens): pass the DP group
only, and token counts from the full (unsharded) rollout masks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lossagg.config import AggregationMode, LossAggregationConfig
from lossagg.denominators import check_group_index, check_group_sizes, check_token_counts, denoms_from_totals
from lossagg.ops import reduce, segment_sum

GRADIENT_CONVENTIONS = ("sum", "mean", "micro_batch_mean", "megatron")


@dataclass(frozen=True)
class StepTotals:
    """Step-global numbers: N samples, P prompt groups, T rollout tokens."""

    num_samples: int
    num_groups: int
    total_tokens: float


class StepPlan:
    """Global per-sample denominators of one optimizer step, for this rank's samples.

    Args:
        config: the aggregation config.
        token_counts: ``[n_local]`` rollout token counts ``M[i]`` of this rank's samples
            (all its micro-batches), from the full rollout masks.
        group_index: ``[n_local]`` prompt-group index of each sample; required under
            prompt_mean. With a process group it must lie in ``[0, num_groups)`` where
            ``num_groups`` is given or ``global_batch_size // n_samples_per_prompt``.
        process_group: the DP group (``torch.distributed``); None for one process.
        num_groups: groups in the step, when group_index is global and
            ``global_batch_size`` is not configured.
    """

    def __init__(
        self,
        config: LossAggregationConfig,
        token_counts: torch.Tensor,
        *,
        group_index: torch.Tensor | None = None,
        process_group=None,
        num_groups: int | None = None,
    ):
        self.config = config
        counts = check_token_counts(token_counts)
        self.device = counts.device
        self.token_counts = counts
        mode = config.mode
        n_local = counts.shape[0]
        distributed = process_group is not None

        dense = None
        g_total = 0
        if mode is AggregationMode.PROMPT_MEAN:
            group_index = check_group_index(group_index, n_local, self.device)
            if distributed:
                # Group labels must mean the same on every rank: global prompt indices.
                g_total = num_groups
                if g_total is None and config.global_batch_size is not None:
                    g_total = config.global_batch_size // config.n_samples_per_prompt
                if g_total is None:
                    raise ValueError(
                        "with a process group, prompt_mean needs the number of groups in the step: set "
                        "global_batch_size in the config or pass num_groups"
                    )
                if n_local and (group_index.min() < 0 or group_index.max() >= g_total):
                    raise ValueError(
                        f"group_index must lie in [0, {g_total}) (global prompt index within the step), "
                        f"got values in [{int(group_index.min())}, {int(group_index.max())}]"
                    )
                labels = torch.arange(g_total, device=self.device)
                dense = group_index.long()
            else:
                labels, dense = torch.unique(group_index, return_inverse=True)
                g_total = labels.numel()

        # One buffer, one all-reduce: [N, T, group sizes (G), group token sums (G)].
        buf = torch.zeros(2 + 2 * g_total, dtype=torch.float64, device=self.device)
        buf[0] = n_local
        buf[1] = counts.sum()
        if dense is not None:
            buf[2 : 2 + g_total].index_add_(0, dense, torch.ones_like(counts))
            buf[2 + g_total :].index_add_(0, dense, counts)
        if distributed:
            import torch.distributed as dist

            dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=process_group)

        group_sums = None
        p_total = 0
        if dense is not None:
            sizes = buf[2 : 2 + g_total]
            check_group_sizes(labels, sizes.long(), config.n_samples_per_prompt)
            p_total = int((sizes > 0).sum().item())
            group_sums = buf[2 + g_total :][dense]
        self.totals = StepTotals(num_samples=int(round(buf[0].item())), num_groups=p_total, total_tokens=float(buf[1].item()))
        self.sample_denoms = denoms_from_totals(
            mode.value,
            counts,
            num_samples=self.totals.num_samples,
            total_tokens=self.totals.total_tokens,
            num_groups=p_total,
            group_token_sums=group_sums,
            divisor=config.divisor,
        )
        # The default reducer (sample_mean), for metrics other than the PG loss.
        self.metric_denoms = denoms_from_totals("sample_mean", counts, num_samples=self.totals.num_samples, total_tokens=self.totals.total_tokens)

    def denoms(self, samples: slice | Sequence[int] | torch.Tensor, *, dtype=torch.float32, device=None) -> torch.Tensor:
        """Denominators of a micro-batch, given its samples' positions among this rank's samples."""
        d = self.sample_denoms[_select(samples, self.device)]
        return d.to(dtype=dtype, device=device or self.device)

    def loss(
        self,
        per_token_loss: torch.Tensor,
        mask: torch.Tensor,
        samples: slice | Sequence[int] | torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """This micro-batch's contribution to J (on this CP rank's tokens, if sharded)."""
        d = self.denoms(samples, dtype=torch.float64, device=per_token_loss.device)
        return reduce(per_token_loss, mask, d, cu_seqlens)

    def metrics(
        self,
        metrics: dict[str, torch.Tensor],
        mask: torch.Tensor,
        samples: slice | Sequence[int] | torch.Tensor,
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
        stacked = torch.stack([metrics[k].detach() for k in names])
        sums = segment_sum(stacked, mask, cu_seqlens)
        d = self.metric_denoms[_select(samples, self.device)].to(sums.device, torch.float64)
        contrib = (sums.to(torch.float64) / d).sum(-1)
        return {k: contrib[i] for i, k in enumerate(names)}


def _select(samples, device):
    if isinstance(samples, slice):
        return samples
    return torch.as_tensor(samples, dtype=torch.long, device=device)


def gradient_scale(convention: str, *, dp_size: int = 1, cp_size: int = 1, num_micro_batches: int = 1) -> float:
    """Factor to multiply each contribution by so the final gradient is dJ/dθ.

    * ``sum``: gradients are summed over micro-batches and ranks -> 1.
    * ``mean``: DDP/FSDP average gradients over the DP×CP world -> ``dp_size * cp_size``.
    * ``micro_batch_mean``: the trainer divides each micro-batch loss by the number of
      micro-batches -> ``num_micro_batches``.
    * ``megatron``: Megatron without per-token loss does both (divides by micro-batches and
      averages over DP×CP) -> ``num_micro_batches * dp_size * cp_size``.
    """
    for name, v in (("dp_size", dp_size), ("cp_size", cp_size), ("num_micro_batches", num_micro_batches)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
    if convention == "sum":
        return 1.0
    if convention == "mean":
        return float(dp_size * cp_size)
    if convention == "micro_batch_mean":
        return float(num_micro_batches)
    if convention == "megatron":
        return float(num_micro_batches * dp_size * cp_size)
    raise ValueError(f"convention must be one of {', '.join(GRADIENT_CONVENTIONS)}, got {convention!r}")


# --------------------------------------------------------------- context parallel
def zigzag_chunk_sizes(cu_seqlens: torch.Tensor, cp_size: int) -> torch.Tensor:
    """Chunk size of each sequence: ceil(len / (2 cp)) (sequences padded to a multiple of 2 cp)."""
    if cp_size < 1:
        raise ValueError(f"cp_size must be >= 1, got {cp_size}")
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    return (lengths + 2 * cp_size - 1) // (2 * cp_size)


def zigzag_local_cu_seqlens(cu_seqlens: torch.Tensor, cp_size: int) -> torch.Tensor:
    """``cu_seqlens`` of a CP rank's local tokens (every rank holds 2 chunks of each sequence)."""
    chunks = zigzag_chunk_sizes(cu_seqlens, cp_size)
    out = torch.zeros(chunks.numel() + 1, dtype=cu_seqlens.dtype, device=cu_seqlens.device)
    out[1:] = torch.cumsum(2 * chunks, 0)
    return out


def zigzag_positions(cu_seqlens: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Global token position of each local token of ``cp_rank`` (-1 for padding).

    Sequence i is padded to ``2 cp c_i`` tokens and cut into ``2 cp`` chunks of ``c_i``;
    rank r holds chunks r and ``2 cp - 1 - r``.
    """
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be in [0, {cp_size}), got {cp_rank}")
    chunks = zigzag_chunk_sizes(cu_seqlens, cp_size)
    starts = cu_seqlens[:-1].long()
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    local_lengths = 2 * chunks
    total = int(local_lengths.sum())
    seq = torch.repeat_interleave(torch.arange(chunks.numel(), device=cu_seqlens.device), local_lengths, output_size=total)
    local_starts = torch.cumsum(local_lengths, 0) - local_lengths
    j = torch.arange(total, device=cu_seqlens.device) - local_starts[seq]
    c = chunks[seq]
    within = torch.where(j < c, cp_rank * c + j, (2 * cp_size - 1 - cp_rank) * c + (j - c))
    return torch.where(within < lengths[seq], starts[seq] + within, torch.full_like(within, -1))


def zigzag_shard(x: torch.Tensor, cu_seqlens: torch.Tensor, cp_size: int, cp_rank: int, pad_value=0) -> torch.Tensor:
    """This CP rank's tokens of a packed tensor (tokens on the last dim), padding filled with ``pad_value``."""
    pos = zigzag_positions(cu_seqlens, cp_size, cp_rank).to(x.device)
    gathered = x.index_select(-1, pos.clamp(min=0))
    pad = torch.full((), pad_value, dtype=x.dtype, device=x.device)
    return torch.where(pos >= 0, gathered, pad)
