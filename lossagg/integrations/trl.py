"""TRL's ``GRPOTrainer`` with the policy loss aggregated by lossagg (written against TRL 1.16).

Switch with one line::

    # from trl import GRPOTrainer
    from lossagg.integrations.trl import GRPOTrainer

``GRPOConfig.loss_type`` then accepts TRL's names and lossagg's (the mode each TRL name
becomes is the registry's alias of that name, :data:`lossagg.ALIASES`; :data:`TRL_LOSS_TYPES`):

============  ==============================================================================
loss_type     aggregation (J of the whole optimizer step, on every rank and split)
============  ==============================================================================
grpo          ``sample_mean`` (TRL's maths; equal to TRL's result)
dapo          ``token_mean`` over the step's tokens (TRL's maths; equal to TRL's result)
dr_grpo       ``constant`` with divisor ``max_completion_length`` (equal to TRL's result)
bnpo          what ``dapo`` is, over the *step's* tokens: TRL divides by each micro-batch's
              tokens, so its loss changes with the accumulation split; a warning says so
cispo, vespo  TRL's objective per token, on ``token_mean`` (TRL's reducer; equal to TRL's result)
sapo          TRL's objective per token, on ``sample_mean`` (equal to TRL's result)
luspo         the clipped surrogate on ``constant`` with divisor 1 (equal to TRL's result)
a mode        any of lossagg's modes (:data:`lossagg.MODES`); a mode with prompt groups
              groups the ``num_generations`` completions of each prompt (TRL's advantage
              groups), a mode with a divisor takes it from ``loss_aggregation`` or, by
              default, ``max_completion_length``
============  ==============================================================================

A full :class:`lossagg.LossAggregationConfig` can be given instead with
``GRPOTrainer(..., loss_aggregation=config)``. ``GRPOTrainer(..., empty_samples="skip")``
sets the config's ``empty_samples`` for the config ``loss_type`` stands for (docs/modes.md,
"Empty samples"): completions without a loss token then count nowhere, where TRL's own
``grpo`` and ``dr_grpo`` count every completion (the default, ``"count"``, keeps TRL's number).

How it stays exact: TRL shuffles each generation batch and cuts it into ``steps_per_generation``
micro-batches; optimizer step ``s`` takes micro-batches ``[s·A, (s+1)·A)`` on every process
(``A = gradient_accumulation_steps``; ``steps_per_generation`` must be a multiple of it). For each
step the adapter gathers those completions' loss-token counts over the processes, builds the
step's :class:`lossagg.StepPlan` and hands it to each of the step's micro-batches with the
positions of its completions; each micro-batch's loss is ``plan.loss(values, plan.micro_batch(...))``
times the process count (DDP/FSDP average gradients over processes), so the micro-batch
gradients add up to the gradient of J whatever the split.

The loss mask is TRL's (``completion_mask``, times ``tool_mask`` when present) and a weight,
as in TRL: ``M[i]`` and ``T`` are its sums, so a fractional mask (an ``env_mask`` of
weights, say) gives TRL's number for ``grpo``, ``dapo`` and ``dr_grpo``, and lossagg's
modes read the same sums. A negative or non-finite entry is refused, naming its position.

The per-token objective is TRL's: the clipped surrogate (token- or sequence-level importance
sampling, ``epsilon_low``/``epsilon_high``, ``delta``) or the ``cispo``, ``sapo``, ``vespo``
objective, each on the mode of TRL's own reducer for it (:data:`OBJECTIVES`; ``luspo`` is the
clipped surrogate on ``constant`` with divisor 1), with vLLM's importance-sampling correction,
the off-policy mask and the top-entropy mask. The other terms (docs/trainers/trl.md):

* the KL penalty (``beta``) stays inside the per-token loss, as TRL has it, unless a
  ``loss_aggregation`` config names the term ``kl`` (coefficient ``beta``): then it is reduced on
  that term's mode;
* the entropy bonus (``entropy_coef``, or TRL's adaptive controller) is the term ``entropy``, with
  coefficient ``-entropy_coef``, on ``token_mean`` over the optimizer step (TRL takes each
  micro-batch's token mean) or on the mode of the config's term ``entropy``; refused under
  ``top_entropy_quantile < 1``, where TRL picks its tokens per micro-batch;
* a MoE router's auxiliary loss, one number per micro-batch, is weighted by the micro-batch's
  share of the step's loss tokens (``lossagg.step.scalar_share``), where TRL divides it by the
  accumulation steps.

An empty step (no loss token on any process, ``StepPlan.empty``) skips its optimizer step, so weight
decay and momentum do not move the weights for it; ``trainer.lossagg_skipped_steps`` counts them.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch

try:
    from trl import GRPOTrainer as _TRLGRPOTrainer
except ModuleNotFoundError as exc:  # pragma: no cover - exercised only without TRL
    # a ModuleNotFoundError, as for any missing package: pytest.importorskip skips on it
    raise ModuleNotFoundError(f"lossagg.integrations.trl needs TRL (pip install trl): {exc}", name="trl") from exc
except ImportError as exc:  # pragma: no cover - a TRL without GRPOTrainer, or one that fails to import
    raise ImportError(f"lossagg.integrations.trl needs TRL with its GRPOTrainer (written against TRL 1.16): {exc}") from exc

from lossagg.config import ConfigError, LossAggregationConfig
from lossagg.integrations.trl_checks import ENTROPY_MODE as ENTROPY_MODE  # this module's name for it, as before the checks moved
from lossagg.integrations.trl_checks import REFUSAL, refusals
from lossagg.modes import ALIASES, MODES, canonical_mode, divisor_for
from lossagg.step import StepPlan, gradient_scale, scalar_share
from lossagg.validate import as_int, weight_violation

__all__ = ["GRPOTrainer", "TRL_LOSS_TYPES", "config_for_loss_type"]

#: TRL loss types whose aggregation lossagg takes over, and the lossagg mode each becomes: the
#: registry's alias of each name (the config refuses ``bnpo`` as a name; here it is taken as
#: ``dapo``, with a warning).
TRL_LOSS_TYPES: Mapping[str, str] = {**{name: ALIASES[name].mode for name in ("grpo", "dapo", "dr_grpo")}, "bnpo": ALIASES["dapo"].mode}
#: TRL's other per-token objectives (not the clipped surrogate), each computed here as TRL computes it per token
#: (``trl/trainer/grpo_trainer.py``, ``GRPOTrainer._compute_loss``), and the lossagg mode TRL's own reducer
#: for it is: ``cispo`` and ``vespo`` divide by the step's tokens (dapo's ``num_items_in_batch``), ``sapo``
#: takes each completion's token mean (grpo's), ``luspo`` each completion's token sum over the completions.
OBJECTIVES: Mapping[str, dict[str, Any]] = {
    "cispo": {"mode": "token_mean"},
    "vespo": {"mode": "token_mean"},
    "sapo": {"mode": "sample_mean"},
    "luspo": {"mode": "constant", "divisor": 1.0},
}
# Inputs TRL's _compute_loss forwards to the model (multimodal models); passed on when present.
_MODEL_INPUT_KEYS = (
    "pixel_values",
    "image_grid_thw",
    "num_images",
    "pixel_attention_mask",
    "spatial_shapes",
    "num_tiles",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
)
PLAN_KEY = "lossagg_plan"  # the optimizer step's StepPlan (every process's completions of the step), in each of its micro-batches
SAMPLES_KEY = "lossagg_samples"  # the micro-batch's completions among the plan's samples (a slice)
GROUP_KEY = "lossagg_group"  # each completion's prompt group, tagged before TRL shuffles the generation batch


def config_for_loss_type(
    loss_type: str, *, num_generations: int, max_completion_length: int | None, empty_samples: str | None = None
) -> LossAggregationConfig:
    """The lossagg config a ``GRPOConfig.loss_type`` stands for (see the module docstring), with
    ``empty_samples`` when given (the config's default, ``"count"``, otherwise)."""
    if not isinstance(loss_type, str):
        raise TypeError(f"loss_type must be a string, got {type(loss_type).__name__}")
    given, loss_type = loss_type, loss_type.strip().lower()  # TRL's names, as the config reads mode names
    if loss_type in OBJECTIVES:  # TRL's per-token objective, on the mode of TRL's own reducer for it, over the step
        settings = {**OBJECTIVES[loss_type], **({} if empty_samples is None else {"empty_samples": empty_samples})}
        return LossAggregationConfig.from_dict(settings, source=f"GRPOConfig.loss_type={loss_type}")
    num_generations = as_int("num_generations", num_generations, minimum=1)
    if max_completion_length is not None:
        max_completion_length = as_int("max_completion_length", max_completion_length, minimum=1)
    mode = TRL_LOSS_TYPES.get(loss_type, loss_type)
    if loss_type == "bnpo":
        warnings.warn(
            f"loss_type='bnpo': lossagg divides by the tokens of the whole optimizer step ({mode}, the same as TRL's 'dapo'); "
            "TRL's 'bnpo' divides by each micro-batch's tokens, so its loss changes with the gradient-accumulation split",
            UserWarning,
            stacklevel=3,
        )
    try:
        canonical, alias = canonical_mode(mode)
    except ValueError as exc:
        raise ValueError(f"loss_type={given!r}: {exc}") from None
    settings: dict[str, Any] = {"mode": mode, **({} if empty_samples is None else {"empty_samples": empty_samples})}
    if canonical in MODES:
        try:
            divisor = divisor_for(MODES[canonical], default=max_completion_length, alias=alias, default_name="GRPOConfig.max_completion_length")
        except ValueError as exc:
            raise ValueError(f"loss_type={loss_type!r}: {exc}") from None
        if divisor is not None:
            settings["divisor"] = divisor
    try:
        config = LossAggregationConfig.from_dict(settings, source="GRPOConfig.loss_type")
    except ConfigError as exc:
        if any(path == "empty_samples" for path, _ in exc.issues):
            raise ValueError(f"empty_samples: {dict(exc.issues)['empty_samples']}") from None
        raise ValueError(
            f"loss_type must be one of TRL's {', '.join(TRL_LOSS_TYPES)} or lossagg's {', '.join(MODES)} (or a migration name), got {given!r}: {exc}"
        ) from None
    if MODES[config.mode].needs_groups:
        # through validation again (model_copy would skip it)
        config = LossAggregationConfig.from_dict({**config.model_dump(exclude_unset=True, mode="json"), "n_samples_per_prompt": num_generations})
    return config


def _check_weights(mask: torch.Tensor, with_tool_mask: bool) -> None:
    """TRL multiplies each token's loss by its loss-mask entry and divides by sums of the
    mask, so any finite entry >= 0 is a weight with TRL's number. A negative or non-finite
    one is refused: lossagg's step totals are sums of non-negative counts."""
    found = weight_violation(mask)
    if found is not None:
        name = "completion_mask * tool_mask" if with_tool_mask else "completion_mask"
        raise ValueError(f"the loss mask ({name}) must hold finite weights >= 0, got {found[0]!r} at [{', '.join(map(str, found[1]))}]")


class GRPOTrainer(_TRLGRPOTrainer):
    """``trl.GRPOTrainer`` whose policy loss is aggregated by lossagg, exactly per optimizer step.

    Takes TRL's arguments, plus ``loss_aggregation`` (a :class:`lossagg.LossAggregationConfig`
    or a mapping of its settings) to set the mode directly instead of through
    ``args.loss_type``, or ``empty_samples`` (``"count"`` or ``"skip"``) for the config that
    ``args.loss_type`` stands for (with ``loss_aggregation``, set it there).
    """

    def __init__(self, *args, loss_aggregation: LossAggregationConfig | Mapping | None = None, empty_samples: str | None = None, **kwargs):
        if loss_aggregation is not None and empty_samples is not None:
            raise ValueError(
                f"empty_samples={empty_samples!r} is for the config loss_type stands for; with loss_aggregation, set empty_samples "
                "in it (one place for each setting)"
            )
        super().__init__(*args, **kwargs)
        targs = self.args
        if loss_aggregation is not None:
            config = LossAggregationConfig.from_dict(loss_aggregation) if isinstance(loss_aggregation, Mapping) else loss_aggregation
            if not isinstance(config, LossAggregationConfig):
                raise TypeError(f"loss_aggregation must be a LossAggregationConfig or a mapping of its settings, got {type(config).__name__}")
            if MODES[config.mode].needs_groups:
                if config.n_samples_per_prompt is None:
                    config = LossAggregationConfig.from_dict(
                        {**config.model_dump(exclude_unset=True, mode="json"), "n_samples_per_prompt": self.num_generations}
                    )
                elif config.n_samples_per_prompt != self.num_generations:
                    raise ValueError(
                        f"loss_aggregation.n_samples_per_prompt={config.n_samples_per_prompt} promises prompt groups of that size, but "
                        f"GRPOConfig.num_generations={self.num_generations}: TRL's advantage groups are num_generations completions"
                    )
        else:
            config = config_for_loss_type(
                targs.loss_type, num_generations=self.num_generations, max_completion_length=targs.max_completion_length, empty_samples=empty_samples
            )
        config, refused = refusals(
            config,
            targs,
            beta=self.beta,
            entropy_coef=self.entropy_coef,
            top_entropy_quantile=self.top_entropy_quantile,
            entropy_enabled=self._entropy_bonus_enabled,
        )
        if refused:
            raise ValueError(REFUSAL + "; ".join(refused))
        self.loss_aggregation = config
        self._lossagg_step_empty = False
        self._lossagg_planned = None  # the generation batch (TRL's buffer) whose steps are planned
        #: optimizer steps skipped because their generation batch held no loss token on any process
        self.lossagg_skipped_steps = 0

    # ------------------------------------------------------------------ step plan
    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        mask = self._loss_mask(output)
        n_local = mask.shape[0]
        # each completion's prompt group (TRL's advantage groups: num_generations consecutive completions of the
        # gathered batch), tagged before TRL shuffles the batch and cuts it into optimizer steps
        group_size = self.num_generations if self.model.training else self.num_generations_eval
        start = self.accelerator.process_index * n_local
        output[GROUP_KEY] = torch.arange(start, start + n_local, device=mask.device) // group_size
        if self.model.training:
            self._guard_optimizer_step()
        else:  # evaluation: the batch is the step (no buffer, no accumulation)
            self._plan_step([output], group_size)
        return output

    def _prepare_inputs(self, generation_batch):
        inputs = super()._prepare_inputs(generation_batch)
        buffer = getattr(self, "_buffered_inputs", None)
        if self.model.training and buffer is not None and buffer is not self._lossagg_planned:
            # a new generation batch, cut by TRL into steps_per_generation micro-batches: optimizer step s takes
            # micro-batches [s·A, (s+1)·A) on every process (A = gradient_accumulation_steps), one plan each
            accumulation = self.args.gradient_accumulation_steps
            for first in range(0, len(buffer), accumulation):
                self._plan_step(buffer[first : first + accumulation], self.num_generations)
            self._lossagg_planned = buffer
        return inputs

    def _guard_optimizer_step(self) -> None:
        """An empty step (no loss token on any process: ``StepPlan.empty``) has ``J = 0`` and zero gradients,
        but an optimizer step would still move the weights (weight decay, momentum): the optimizer's step is
        skipped for it, counted in ``lossagg_skipped_steps``. Every micro-batch of a step carries its plan's
        ``empty``, read when its loss is computed."""
        optimizer = getattr(self, "optimizer", None)
        if optimizer is None or getattr(optimizer, "_lossagg_guarded", False):
            return
        step = optimizer.step
        trainer = self

        def step_unless_empty(*args, **kwargs):
            if trainer._lossagg_step_empty:
                trainer.lossagg_skipped_steps += 1
                return None
            return step(*args, **kwargs)

        optimizer.step = step_unless_empty
        optimizer._lossagg_guarded = True

    def _loss_mask(self, batch) -> torch.Tensor:
        mask = batch["completion_mask"]
        return mask if batch.get("tool_mask") is None else mask * batch["tool_mask"]

    def _plan_step(self, micro_batches: list[dict], group_size: int) -> None:
        """One optimizer step's plan over ``micro_batches`` (this process's) and the same micro-batches of every
        other process, from one gather of their completions' loss-token counts; hands it to each micro-batch
        with its completions' positions among the plan's samples.

        ``M[i]`` is the sum of the completion's loss mask, as TRL's normalisers take it
        (``trl/trainer/grpo_trainer.py``, ``GRPOTrainer._compute_loss``: ``mask.sum(-1)`` for
        grpo, ``num_items_in_batch``, the gathered ``loss_mask.sum()``, for dapo): a fractional
        mask is a weight there and here alike.
        """
        for mb in micro_batches:
            _check_weights(self._loss_mask(mb), mb.get("tool_mask") is not None)
        counts = torch.cat([self._loss_mask(mb).sum(-1).to(torch.float64) for mb in micro_batches])
        groups = torch.cat([mb[GROUP_KEY] for mb in micro_batches])
        n_local = counts.shape[0]
        gathered = self.accelerator.gather(torch.stack([counts, groups.to(torch.float64)]).T.contiguous())
        all_counts, all_groups = gathered[:, 0], gathered[:, 1].to(torch.int64)
        config = self.loss_aggregation
        group_index = None
        if MODES[config.mode].needs_groups:
            group_index = all_groups
            if config.n_samples_per_prompt is not None and config.n_samples_per_prompt != group_size:
                config = config.model_copy(update={"n_samples_per_prompt": group_size})
        plan = StepPlan(config, all_counts, group_index=group_index)
        first = self.accelerator.process_index * n_local
        for mb in micro_batches:  # each micro-batch carries the step's plan and its completions' positions in it
            rows = slice(first, first + mb[GROUP_KEY].shape[0])
            first = rows.stop
            mb[PLAN_KEY], mb[SAMPLES_KEY] = plan, rows

    # ------------------------------------------------------------------ the loss
    def _compute_loss(self, model, inputs):
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        mask = self._loss_mask(inputs)
        extra = {key: inputs[key] for key in _MODEL_INPUT_KEYS if inputs.get(key) is not None}
        logps, entropies, aux_loss = self._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, completion_ids.size(1), compute_entropy=True, compute_aux_loss=self.aux_loss_enabled, **extra
        )
        plan = inputs[PLAN_KEY]
        terms = plan.config.terms
        kl_apart = "kl" in terms
        per_token_loss, is_clipped, per_token_kl = surrogate(self, inputs, logps, entropies, mask, kl_apart=kl_apart)
        if self.model.training:
            self._lossagg_step_empty = plan.empty  # the same on every process: gathered totals
        # a per-sample (B, 1) value is broadcast over its tokens (the op reads every element from memory)
        mb = plan.micro_batch(inputs[SAMPLES_KEY], mask)
        values = {"pg": per_token_loss.expand_as(mask).contiguous(), **({"kl": per_token_kl} if kl_apart else {})}
        # each term's share of its J over the step (the KL penalty, the term 'kl' on its own mode: beta · J_kl), times the process
        # count (DDP/FSDP average over processes)
        scale = gradient_scale("mean", dp_size=self.accelerator.num_processes)
        loss = plan.loss(values, mb, terms=tuple(values)) * scale
        mode = "train" if self.model.training else "eval"
        if "entropy" in terms:  # the entropy bonus, the term 'entropy' on its own mode: -entropy_coef · J_entropy
            coefficient = terms["entropy"].coefficient
            if self.use_adaptive_entropy:  # TRL's controller: the coefficient set at the end of the previous step, for the whole step
                coefficient = -(self.entropy_coef if self._last_world_entropy <= self.args.entropy_target else 0.0)
            loss = loss + coefficient * plan.loss(entropies, mb, terms="entropy", coefficients=False) * scale
            if self.use_adaptive_entropy and mode == "train":
                self._adapt_entropy_coef(entropies, mask)
            if mode == "train" and self.accelerator.sync_gradients:
                self._metrics[mode]["entropy_coef"].append(self.entropy_coef)
        if aux_loss is not None:
            # the router's auxiliary loss, one number per micro-batch: weighted by the micro-batch's share of the step's
            # loss tokens (docs/terms.md, "Scalar terms"), where TRL divides it by the accumulation steps
            own = mask.sum().to(torch.float64)
            loss = loss + self.router_aux_loss_coef * scalar_share(aux_loss, own, plan.totals.total_tokens) * scale
            self._metrics[mode]["aux_loss"].append(self.accelerator.gather_for_metrics(aux_loss.detach()).mean().item())

        bool_mask = mask.bool()
        self._metrics[mode]["entropy"].append(self._global_mean(entropies[bool_mask]))
        self._metrics[mode]["clip_ratio/region_mean"].append(self._global_mean(is_clipped.expand_as(mask)[bool_mask].float()))
        return loss

    def _adapt_entropy_coef(self, entropies: torch.Tensor, mask: torch.Tensor) -> None:
        """TRL's adaptive entropy controller (``use_adaptive_entropy``; ``trl/trainer/grpo_trainer.py``,
        ``GRPOTrainer._compute_loss``): the step's token-weighted mean entropy over every process, from each
        micro-batch's entropy sum and token count; at the optimizer-step boundary the coefficient moves by
        ``entropy_coef_delta`` towards more bonus when that mean is at or below ``entropy_target``, less otherwise,
        within ``[entropy_coef_min, entropy_coef_max]``. It takes effect from the next step."""
        stats = torch.stack([(entropies * mask).sum(), mask.sum()]).detach()
        self._entropy_window_stats = stats if self._entropy_window_stats is None else self._entropy_window_stats + stats
        if not self.accelerator.sync_gradients:
            return
        window = self.accelerator.reduce(self._entropy_window_stats, reduction="sum")
        world_entropy = (window[0] / window[1].clamp(min=1.0)).item()
        args = self.args
        if world_entropy <= args.entropy_target:
            self.entropy_coef = min(self.entropy_coef + args.entropy_coef_delta, args.entropy_coef_max)
        else:
            self.entropy_coef = max(self.entropy_coef - args.entropy_coef_delta, args.entropy_coef_min)
        self._last_world_entropy = world_entropy
        self._entropy_window_stats = None

    def _global_mean(self, x: torch.Tensor) -> float:
        totals = self.accelerator.gather(torch.stack([x.detach().float().sum(), x.new_tensor(x.numel(), dtype=torch.float32)]).unsqueeze(0))
        totals = totals.reshape(-1, 2).sum(0)
        return (totals[0] / totals[1].clamp(min=1.0)).item()


def surrogate(trainer, inputs, logps, entropies, mask, *, kl_apart: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """TRL's per-token objective before aggregation (the clipped surrogate, or ``cispo``, ``sapo``, ``vespo``
    as TRL computes them), where it clipped, and the per-token KL penalty (``beta`` times it is in the first
    unless ``kl_apart``, where the KL is the term 'kl')."""
    advantages = inputs["advantages"]
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    old_logps = inputs.get("old_per_token_logps")
    old_logps = logps.detach() if old_logps is None else old_logps
    log_ratio = logps - old_logps
    if trainer.importance_sampling_level == "sequence":
        log_weights = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    elif trainer.importance_sampling_level == "token":
        log_weights = log_ratio
    else:
        raise ValueError(f"importance_sampling_level must be 'token' or 'sequence', got {trainer.importance_sampling_level!r}")
    ratio = torch.exp(log_weights)
    objective = trainer.loss_type if trainer.loss_type in OBJECTIVES else "clip"
    if objective == "cispo":
        # the ratio capped at epsilon_high, as a constant weight of the log-probability
        per_token_loss = -torch.clamp(ratio, max=trainer.epsilon_high).detach() * advantages * logps
        is_clipped = ratio > trainer.epsilon_high
    elif objective == "sapo":
        temperatures = torch.where(advantages > 0, trainer.args.sapo_temperature_pos, trainer.args.sapo_temperature_neg)
        per_token_loss = -(torch.sigmoid(temperatures * (ratio - 1)) * 4 / temperatures) * advantages
        is_clipped = torch.zeros_like(per_token_loss, dtype=torch.bool)
    elif objective == "vespo":
        phi = trainer.get_gamma_weights(
            advantages=advantages,
            log_ratio_per_token=log_ratio,
            mask=mask,
            importance_sampling_ratio=inputs.get("importance_sampling_ratio"),
            k_pos=trainer.args.vespo_k_pos,
            lambda_pos=trainer.args.vespo_lambda_pos,
            k_neg=trainer.args.vespo_k_neg,
            lambda_neg=trainer.args.vespo_lambda_neg,
        )
        per_token_loss = -phi * advantages * logps
        is_clipped = torch.zeros_like(per_token_loss, dtype=torch.bool)
    else:  # the clipped surrogate (grpo, dapo, dr_grpo, bnpo, luspo and lossagg's modes)
        clipped = torch.clamp(ratio, 1 - trainer.epsilon_low, 1 + trainer.epsilon_high)
        ratio_for_loss = ratio if trainer.args.delta is None else torch.clamp(ratio, max=trainer.args.delta)
        unclipped_term = ratio_for_loss * advantages
        clipped_term = clipped * advantages
        per_token_loss = -torch.min(unclipped_term, clipped_term)
        is_clipped = clipped_term < unclipped_term

    if trainer.off_policy_mask_threshold is not None:
        sampling_logps = inputs.get("sampling_per_token_logps", old_logps)
        per_token_loss = per_token_loss * trainer.get_off_policy_mask(advantages, logps, sampling_logps, mask, trainer.off_policy_mask_threshold)
    if trainer.top_entropy_quantile < 1.0:
        per_token_loss = per_token_loss * trainer.get_high_entropy_mask(entropies, mask, 1 - trainer.top_entropy_quantile)
    if trainer.use_vllm and trainer.vllm_importance_sampling_correction and objective != "vespo":
        per_token_loss = per_token_loss * inputs["importance_sampling_ratio"]
    kl = None
    if trainer.beta != 0.0:
        ref = inputs["ref_per_token_logps"]
        kl = torch.exp(ref - logps) - (ref - logps) - 1
        if trainer.args.use_bias_correction_kl:
            kl = kl * ratio
        if not kl_apart:
            per_token_loss = per_token_loss + trainer.beta * kl
    return per_token_loss, is_clipped, kl
