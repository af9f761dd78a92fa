"""lossagg.integrations.trl.GRPOTrainer driven by the real, installed TRL on CPU.

A tiny randomly initialised Llama (float64, so that float rounding does not hide a
split dependence) and a word-level tokenizer built here (no downloads) run real
``GRPOTrainer.train()`` steps: TRL generates, scores, shuffles and splits the batch into
gradient-accumulation micro-batches. The gradient of the first optimizer step is captured
just before the optimizer and compared:

* with 1, 2 and 4 accumulation steps over the same generation batch (ours: equal for every
  mode; TRL's own ``bnpo``: not equal, which shows the comparison can fail);
* against TRL's own trainer for the names whose maths lossagg shares (grpo, dapo, dr_grpo).

Then the adapter's refusals: unsupported settings, and ``config_for_loss_type`` on hostile
numbers and spellings (refused naming the argument, or the config it stands for).

Skipped, with the reason, when TRL is not importable (scripts/install_peers.sh installs it).
"""

from __future__ import annotations

import os
import sys
import warnings

import numpy as np
import pytest
import torch
from hostile_numbers import PROPERTY, int_like, numbers, refused_naming
from hypothesis import given
from hypothesis import strategies as st

# no network: TRL/huggingface_hub would otherwise send telemetry or look up the Hub
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

trl = pytest.importorskip("trl", reason="TRL is not importable (scripts/install_peers.sh installs it)")
datasets = pytest.importorskip("datasets", reason="datasets (TRL's dependency) is not importable")
tokenizers = pytest.importorskip("tokenizers", reason="tokenizers (transformers' dependency) is not importable")
transformers = pytest.importorskip("transformers")
try:
    from trl import GRPOTrainer as TRLGRPOTrainer  # noqa: E402  (TRL imports lazily; a missing dependency shows here)
except Exception as exc:  # pragma: no cover
    pytest.skip(f"trl.GRPOTrainer is not importable: {exc}", allow_module_level=True)

from lossagg.config import LossAggregationConfig  # noqa: E402
from lossagg.integrations.trl import PLAN_KEY, SAMPLES_KEY, TRL_LOSS_TYPES, GRPOTrainer, config_for_loss_type  # noqa: E402
from lossagg.modes import MODES  # noqa: E402
from lossagg.testing import reference_loss  # noqa: E402

WORDS = [f"w{i}" for i in range(20)]
VOCAB = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
GENERATION_BATCH = 8
NUM_GENERATIONS = 4
MAX_COMPLETION = 8


def make_tokenizer():
    tk = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab=VOCAB, unk_token="<unk>"))
    tk.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def make_dataset():
    return datasets.Dataset.from_dict({"prompt": [" ".join(WORDS[i : i + 3]) for i in range(8)]})


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="module")
def dataset():
    return make_dataset()


#: the sizes and special tokens of the tiny models (a Llama, and a Mixtral for the router's loss)
TINY = dict(vocab_size=len(VOCAB), hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2)
TINY.update(max_position_embeddings=64, pad_token_id=0, eos_token_id=1, bos_token_id=None)


def tiny_model():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).double()


def reward(completions, **kwargs):
    # varies within a prompt group (completion lengths differ), so advantages are not all 0
    return [float(len(c.split()) % 3) + 0.1 * c.count("w1") for c in completions]


class Capture(transformers.TrainerCallback):
    """The gradient of the first optimizer step, read just before the optimizer runs."""

    def __init__(self):
        self.grads = None

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if self.grads is None:
            self.grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def run(
    trainer_cls, loss_type, accumulation_steps, tmp_path, tokenizer, dataset, *, max_steps=1, trainer_kwargs=None, processes=1, callbacks=(), **config
):
    args = trl.GRPOConfig(
        output_dir=str(tmp_path / f"{trainer_cls.__name__}-{loss_type}-{accumulation_steps}"),
        per_device_train_batch_size=GENERATION_BATCH // (processes * accumulation_steps),
        gradient_accumulation_steps=accumulation_steps,
        num_generations=NUM_GENERATIONS,
        max_completion_length=MAX_COMPLETION,
        max_steps=max_steps,
        learning_rate=1e-2,
        report_to="none",
        use_cpu=True,
        logging_steps=1,
        save_strategy="no",
        loss_type=loss_type,
        seed=0,
        max_grad_norm=0.0,
        **config,
    )
    capture = Capture()
    model = tiny_model()
    if config.get("beta"):  # TRL loads its reference model from the model's path: the same initial weights, saved
        path = tmp_path / f"initial-{type(model).__name__}"
        if not path.exists():
            model.save_pretrained(path)
        model.config._name_or_path = str(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = trainer_cls(
            model=model,
            reward_funcs=reward,
            args=args,
            train_dataset=dataset,
            processing_class=tokenizer,
            callbacks=[capture, *callbacks],
            **(trainer_kwargs or {}),
        )
        trainer.train()
    assert capture.grads, "no gradient was captured"
    return trainer, capture.grads


def relative_difference(a, b) -> float:
    scale = max(v.abs().max().item() for v in a.values())
    assert scale > 0, "the gradient is zero: the comparison would prove nothing"
    return max((a[k] - b[k]).abs().max().item() for k in a) / scale


# TRL's names and every registered mode but those with sessions, which the trainer refuses (its batch has no
# trajectory id: test_a_config_with_more_than_one_unweighted_term_is_refused)
SERVED_MODES = [m for m in MODES if not MODES[m].needs_sessions]
OUR_LOSS_TYPES = [*TRL_LOSS_TYPES, *SERVED_MODES]


@pytest.mark.parametrize("loss_type", OUR_LOSS_TYPES)
def test_gradient_does_not_depend_on_accumulation_steps(loss_type, tmp_path, tokenizer, dataset):
    _, one = run(GRPOTrainer, loss_type, 1, tmp_path, tokenizer, dataset)
    for steps in (2, 4):
        _, split = run(GRPOTrainer, loss_type, steps, tmp_path, tokenizer, dataset)
        assert relative_difference(one, split) < 1e-6, (loss_type, steps)


def test_trl_bnpo_does_depend_on_accumulation_steps(tmp_path, tokenizer, dataset):
    """The same comparison on TRL's own 'bnpo' fails: the check above can see a split dependence."""
    _, one = run(TRLGRPOTrainer, "bnpo", 1, tmp_path, tokenizer, dataset)
    _, two = run(TRLGRPOTrainer, "bnpo", 2, tmp_path, tokenizer, dataset)
    assert relative_difference(one, two) > 1e-3


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_same_gradient_as_trl(loss_type, tmp_path, tokenizer, dataset):
    _, ours = run(GRPOTrainer, loss_type, 2, tmp_path, tokenizer, dataset)
    _, theirs = run(TRLGRPOTrainer, loss_type, 2, tmp_path, tokenizer, dataset)
    assert relative_difference(theirs, ours) < 1e-9


@pytest.mark.parametrize("loss_type", ["dapo", "prompt_mean"])
def test_sequence_level_importance_sampling_is_split_invariant(loss_type, tmp_path, tokenizer, dataset):
    _, one = run(GRPOTrainer, loss_type, 1, tmp_path, tokenizer, dataset, importance_sampling_level="sequence")
    _, two = run(GRPOTrainer, loss_type, 2, tmp_path, tokenizer, dataset, importance_sampling_level="sequence")
    assert relative_difference(one, two) < 1e-6


class Recorder(GRPOTrainer):
    """Keeps every generation batch and every micro-batch loss."""

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        self.generated = getattr(self, "generated", []) + [out]
        return out

    def _compute_loss(self, model, inputs):
        loss = super()._compute_loss(model, inputs)
        self.losses = getattr(self, "losses", []) + [loss.detach()]
        return loss


@pytest.mark.parametrize("loss_type", [*SERVED_MODES, "dr_grpo"])
def test_step_loss_is_the_reference_j(loss_type, tmp_path, tokenizer, dataset):
    """At the first step the ratio is 1, so the per-token loss is -advantage; the micro-batch
    losses of the step add up to J (docs/modes.md) over the generation batch."""
    trainer, _ = run(Recorder, loss_type, 4, tmp_path, tokenizer, dataset)
    batch = trainer.generated[0]
    mask = batch["completion_mask"]
    values = (-batch["advantages"].to(torch.float64))[:, None].expand_as(mask)
    lengths = torch.full((mask.shape[0],), mask.shape[1])
    cu_seqlens = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    group_index = torch.arange(mask.shape[0]) // NUM_GENERATIONS
    config = trainer.loss_aggregation
    expected = reference_loss(config, values.reshape(-1), mask.reshape(-1), cu_seqlens, group_index)
    got = torch.stack(trainer.losses[:4]).sum()
    assert torch.allclose(got.double(), expected, rtol=1e-5, atol=1e-7), (got, expected)  # the loss is float32
    # the step's plan is handed to TRL's micro-batches (its buffer), once they are cut from the generation batch
    assert all(mb[PLAN_KEY].sample_denoms.dtype == torch.float64 for mb in trainer._buffered_inputs)


def test_a_few_real_training_steps(tmp_path, tokenizer, dataset):
    trainer, _ = run(GRPOTrainer, "prompt_mean", 2, tmp_path, tokenizer, dataset, max_steps=3)
    before = tiny_model().state_dict()
    after = trainer.model.state_dict()
    assert any(not torch.equal(before[k], after[k].cpu()) for k in before), "training did not change the model"
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
    assert trainer.loss_aggregation.mode == "prompt_mean"
    assert trainer.loss_aggregation.n_samples_per_prompt == NUM_GENERATIONS


def test_loss_aggregation_config_argument(tmp_path, tokenizer, dataset):
    config = LossAggregationConfig(mode="constant", divisor=3.0)
    trainer, grads = run(GRPOTrainer, "grpo", 2, tmp_path, tokenizer, dataset, trainer_kwargs={"loss_aggregation": config})
    assert trainer.loss_aggregation is config
    _, one = run(GRPOTrainer, "grpo", 1, tmp_path, tokenizer, dataset, trainer_kwargs={"loss_aggregation": {"mode": "constant", "divisor": 3.0}})
    assert relative_difference(one, grads) < 1e-6


class Emptying(Recorder):
    """Makes some completions empty: their loss mask is 0 when their first token id is even (the rule
    reads the completion, so the generation batch and TRL's shuffled micro-batches agree)."""

    def _loss_mask(self, batch):
        mask = super()._loss_mask(batch)
        return mask * (batch["completion_ids"][:, :1] % 2 == 1)


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "prompt_mean"])
def test_empty_samples_skip_through_the_trainer(loss_type, tmp_path, tokenizer, dataset):
    """GRPOTrainer(..., empty_samples="skip"): the step loss is J under skip (docs/modes.md, "Empty
    samples"), which differs from count's on this batch, and does not depend on the accumulation split."""
    trainer, two = run(Emptying, loss_type, 2, tmp_path, tokenizer, dataset, trainer_kwargs={"empty_samples": "skip"})
    assert trainer.loss_aggregation.empty_samples == "skip"
    batch = trainer.generated[0]
    mask = trainer._loss_mask(batch)
    empty = int((mask.sum(-1) == 0).sum())
    assert 0 < empty < mask.shape[0], "the batch must hold empty and non-empty completions for the check to mean anything"
    values = (-batch["advantages"].to(torch.float64))[:, None].expand_as(mask)
    cu_seqlens = torch.arange(0, mask.numel() + 1, mask.shape[1])
    group_index = torch.arange(mask.shape[0]) // NUM_GENERATIONS
    config = trainer.loss_aggregation
    expected = reference_loss(config, values.reshape(-1), mask.reshape(-1), cu_seqlens, group_index)
    got = torch.stack(trainer.losses[:2]).sum()
    assert torch.allclose(got.double(), expected, rtol=1e-5, atol=1e-7), (got, expected)
    counted = reference_loss(config.model_copy(update={"empty_samples": "count"}), values.reshape(-1), mask.reshape(-1), cu_seqlens, group_index)
    group_tokens = torch.zeros(int(group_index.max()) + 1, dtype=mask.dtype).index_add_(0, group_index, mask.sum(-1))
    if loss_type == "prompt_mean" and bool((group_tokens > 0).all()):  # P' = P: skip changes only N, which prompt_mean does not read
        assert torch.allclose(counted, expected, rtol=1e-12, atol=0)
    else:
        assert not torch.allclose(counted, expected, rtol=1e-3), "count and skip must differ on this batch"
    _, one = run(Emptying, loss_type, 1, tmp_path, tokenizer, dataset, trainer_kwargs={"empty_samples": "skip"})
    assert relative_difference(one, two) < 1e-6


def test_empty_samples_through_config_for_loss_type():
    for loss_type, mode in (("grpo", "sample_mean"), ("dr_grpo", "constant"), ("prompt_mean", "prompt_mean")):
        config = config_for_loss_type(loss_type, num_generations=4, max_completion_length=8, empty_samples="skip")
        assert (config.mode, config.empty_samples) == (mode, "skip")
    assert config_for_loss_type("grpo", num_generations=4, max_completion_length=8).empty_samples == "count"
    with pytest.raises(ValueError, match=r"empty_samples: Input should be 'count' or 'skip', got 'Skip'"):
        config_for_loss_type("grpo", num_generations=4, max_completion_length=8, empty_samples="Skip")


def test_empty_samples_beside_a_loss_aggregation_config_is_refused():
    """One place for each setting: with loss_aggregation, empty_samples belongs in it (refused before TRL is set up)."""
    with pytest.raises(ValueError, match=r"empty_samples='skip' is for the config loss_type stands for; with loss_aggregation, set"):
        GRPOTrainer(model=None, loss_aggregation={"mode": "grpo"}, empty_samples="skip")


# ------------------------------------------------------------------ refusals
def test_loss_type_names():
    assert config_for_loss_type("grpo", num_generations=4, max_completion_length=8).mode == "sample_mean"
    assert config_for_loss_type("dapo", num_generations=4, max_completion_length=8).mode == "token_mean"
    dr = config_for_loss_type("dr_grpo", num_generations=4, max_completion_length=8)
    assert (dr.mode, dr.divisor) == ("constant", 8.0)
    pm = config_for_loss_type("prompt_mean", num_generations=4, max_completion_length=8)
    assert (pm.mode, pm.n_samples_per_prompt) == ("prompt_mean", 4)
    assert config_for_loss_type("seq_mean", num_generations=4, max_completion_length=8).mode == "sample_mean"
    with pytest.warns(UserWarning, match="micro-batch"):
        assert config_for_loss_type("bnpo", num_generations=4, max_completion_length=8).mode == "token_mean"
    for objective, mode in (("cispo", "token_mean"), ("vespo", "token_mean"), ("sapo", "sample_mean")):
        assert config_for_loss_type(objective, num_generations=4, max_completion_length=8).mode == mode
    luspo = config_for_loss_type("luspo", num_generations=4, max_completion_length=8)
    assert (luspo.mode, luspo.divisor) == ("constant", 1.0)
    with pytest.raises(ValueError, match=r"loss_type must be one of .* got 'bogus'.*unknown mode"):
        config_for_loss_type("bogus", num_generations=4, max_completion_length=8)
    with pytest.raises(ValueError, match="max_completion_length"):
        config_for_loss_type("constant", num_generations=4, max_completion_length=None)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"loss_type": "dapo", "entropy_coef": 0.1, "top_entropy_quantile": 0.5}, "top_entropy_quantile=0.5"),
        ({"loss_type": "dapo", "steps_per_generation": 3}, "steps_per_generation=3 with gradient_accumulation_steps=2"),
        ({"loss_type": "prompt_mean", "steps_per_generation": 4}, "a mode with prompt groups with steps_per_generation=4"),
        (
            {"loss_type": "dapo", "beta": 0.04, "lossagg_config": {"mode": "token_mean", "terms": {"kl": {"coefficient": 0.5}}}},
            "term 'kl' with coefficient 0.5, where GRPOConfig.beta=0.04",
        ),
    ],
)
def test_unsupported_settings_are_refused(settings, message, tmp_path, tokenizer, dataset):
    settings = dict(settings)
    loss_type = settings.pop("loss_type")
    config = settings.pop("lossagg_config", None)
    with pytest.raises(ValueError, match=message):
        run(GRPOTrainer, loss_type, 2, tmp_path, tokenizer, dataset, trainer_kwargs={"loss_aggregation": config} if config else None, **settings)


def test_evaluation_with_another_group_size(tmp_path, tokenizer, dataset):
    """prompt_mean in evaluation groups TRL's num_generations_eval completions of each prompt."""
    trainer, _ = run(
        Recorder,
        "prompt_mean",
        2,
        tmp_path,
        tokenizer,
        dataset,
        trainer_kwargs={"eval_dataset": dataset},
        num_generations_eval=2,
        per_device_eval_batch_size=4,
    )
    trainer.generated, trainer.losses = [], []
    metrics = trainer.evaluate()
    assert torch.isfinite(torch.tensor(metrics["eval_loss"]))
    batch = trainer.generated[0]
    assert batch["completion_mask"].shape[0] == 4 and batch[PLAN_KEY].sample_denoms[batch[SAMPLES_KEY]].shape == (4,)
    # the eval batch is its own step: its loss is J over its 2 groups of 2 (ratio 1: loss -A)
    mask = batch["completion_mask"]
    values = (-batch["advantages"].to(torch.float64))[:, None].expand_as(mask)
    cu = torch.arange(0, mask.numel() + 1, mask.shape[1])
    config = LossAggregationConfig(mode="prompt_mean", n_samples_per_prompt=2)
    expected = reference_loss(config, values.reshape(-1), mask.reshape(-1), cu, torch.arange(4) // 2)
    assert torch.allclose(trainer.losses[0].double(), expected, rtol=1e-5, atol=1e-7)


def test_a_config_promising_other_groups_is_refused(tmp_path, tokenizer, dataset):
    """num_generations=4 completions per prompt, but the config promises groups of 3."""
    settings = {"mode": "prompt_mean", "n_samples_per_prompt": 3}
    with pytest.raises(ValueError, match=r"n_samples_per_prompt=3 promises .*GRPOConfig.num_generations=4"):
        run(GRPOTrainer, "grpo", 2, tmp_path, tokenizer, dataset, trainer_kwargs={"loss_aggregation": settings})


def test_trl_config_for_loss_type_checks_its_numbers():
    for bad in (0, -2, "4", 2.5, True):
        with pytest.raises(ValueError, match="num_generations"):
            config_for_loss_type("prompt_mean", num_generations=bad, max_completion_length=8)
    with pytest.raises(ValueError, match="max_completion_length"):
        config_for_loss_type("dr_grpo", num_generations=4, max_completion_length=0)
    config = config_for_loss_type("prompt_mean", num_generations=np.int64(4), max_completion_length=8)
    assert config.n_samples_per_prompt == 4 and type(config.n_samples_per_prompt) is int


def test_trl_loss_type_spelling_is_normalised_like_the_config():
    for spelling in ("Dr_GRPO", " dr_grpo ", "DR_GRPO"):
        config = config_for_loss_type(spelling, num_generations=4, max_completion_length=16)
        assert (config.mode, config.divisor) == ("constant", 16.0)
    assert config_for_loss_type(" DAPO", num_generations=4, max_completion_length=None).mode == "token_mean"
    with pytest.raises(ValueError, match="loss_type='Token-Sum': mode 'token-sum' is not supported"):
        config_for_loss_type("Token-Sum", num_generations=4, max_completion_length=16)


@PROPERTY
@given(num_generations=numbers, max_completion_length=numbers, loss_type=st.sampled_from(["grpo", "dr_grpo", "prompt_mean", "max_length"]))
def test_trl_numbers(num_generations, max_completion_length, loss_type):
    trl_adapter = pytest.importorskip("lossagg.integrations.trl", reason="TRL is not importable (scripts/install_peers.sh installs it)")
    call = lambda: trl_adapter.config_for_loss_type(loss_type, num_generations=num_generations, max_completion_length=max_completion_length)  # noqa: E731
    g, m = int_like(num_generations), int_like(max_completion_length)
    if g is None or g < 1:
        return refused_naming(call, "num_generations")
    if max_completion_length is not None and (m is None or m < 1):
        return refused_naming(call, "max_completion_length")
    if loss_type == "dr_grpo" and m is None:
        return refused_naming(call, "max_completion_length")
    config = call()
    assert config.divisor == (float(m) if loss_type == "dr_grpo" else None)
    assert config.n_samples_per_prompt == (g if loss_type == "prompt_mean" else None)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"mode": "grpo", "terms": {"nll": {"coefficient": 0.01}}}, r"loss_aggregation with terms \(nll\)"),
        ({"mode": "grpo", "terms": {"kl": {"coefficient": 0.01}}}, r"loss_aggregation term 'kl' with GRPOConfig.beta=0"),
        ({"mode": "grpo", "terms": {"entropy": {"coefficient": -0.01}}}, r"loss_aggregation term 'entropy' without GRPOConfig.entropy_coef"),
        ({"mode": "grpo", "weighting": "multiply"}, r"loss_aggregation with weighting=multiply"),
        # a batch without trajectory ids: the session modes are refused by name (docs/modes.md, "Sessions")
        (
            {"mode": "session_mean"},
            r"mode=session_mean weighs each session \(multi-turn trajectory\) once and needs each sample's session, which TRL",
        ),
    ],
)
def test_a_config_with_more_than_one_unweighted_term_is_refused(settings, message, tmp_path, tokenizer, dataset):
    """The trainer reduces TRL's per-token loss as one unweighted term (docs/terms.md): a config asking
    for other terms or per-sample weights is refused when the trainer is built, never half-applied."""
    with pytest.raises(ValueError, match="does not support: " + message):
        run(GRPOTrainer, "grpo", 2, tmp_path, tokenizer, dataset, trainer_kwargs={"loss_aggregation": settings})


ENTROPY_COEF = 0.1


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_the_entropy_bonus_is_a_term_exact_under_any_split(loss_type, tmp_path, tokenizer, dataset):
    """TRL's entropy bonus (``entropy_coef``) is the term 'entropy', token_mean over the optimizer step: the same
    gradient with 1, 2 and 4 accumulation steps, and TRL's own with one micro-batch per step (where TRL's
    per-micro-batch token mean is the step's). TRL's own changes with the split: the test says by how much."""
    _, one = run(GRPOTrainer, loss_type, 1, tmp_path, tokenizer, dataset, entropy_coef=ENTROPY_COEF)
    _, trl_one = run(trl.GRPOTrainer, loss_type, 1, tmp_path, tokenizer, dataset, entropy_coef=ENTROPY_COEF)
    assert relative_difference(one, trl_one) < 1e-6
    _, no_bonus = run(GRPOTrainer, loss_type, 1, tmp_path, tokenizer, dataset)
    assert relative_difference(one, no_bonus) > 1e-3, "the entropy bonus changed nothing: the test would prove nothing"
    for steps in (2, 4):
        _, split = run(GRPOTrainer, loss_type, steps, tmp_path, tokenizer, dataset, entropy_coef=ENTROPY_COEF)
        assert relative_difference(one, split) < 1e-6, steps
        _, trl_split = run(trl.GRPOTrainer, loss_type, steps, tmp_path, tokenizer, dataset, entropy_coef=ENTROPY_COEF)
        off = relative_difference(trl_one, trl_split)
        print(f"TRL's own {loss_type} with the entropy bonus, {steps} accumulation steps: {off:.3%} off its one-micro-batch gradient")
        assert off > 1e-4, (steps, off)


def test_the_entropy_term_on_its_own_mode(tmp_path, tokenizer, dataset):
    """A config naming the term 'entropy' puts the bonus on that mode (its coefficient TRL's -entropy_coef)."""
    settings = {"mode": "token_mean", "terms": {"entropy": {"mode": "sample_mean", "coefficient": -ENTROPY_COEF}}}
    kwargs = {"trainer_kwargs": {"loss_aggregation": settings}, "entropy_coef": ENTROPY_COEF}
    _, one = run(GRPOTrainer, "dapo", 1, tmp_path, tokenizer, dataset, **kwargs)
    _, split = run(GRPOTrainer, "dapo", 4, tmp_path, tokenizer, dataset, **kwargs)
    assert relative_difference(one, split) < 1e-6
    _, token_mean = run(GRPOTrainer, "dapo", 1, tmp_path, tokenizer, dataset, entropy_coef=ENTROPY_COEF)
    assert relative_difference(one, token_mean) > 1e-4, "sample_mean and token_mean entropy gave the same gradient"
    bad = {"mode": "token_mean", "terms": {"entropy": {"coefficient": -0.5}}}
    with pytest.raises(ValueError, match="term 'entropy' with coefficient -0.5, where GRPOConfig.entropy_coef=0.1"):
        run(GRPOTrainer, "dapo", 1, tmp_path, tokenizer, dataset, trainer_kwargs={"loss_aggregation": bad}, entropy_coef=ENTROPY_COEF)


class EmptyStep(GRPOTrainer):
    """The adapter with every completion's loss mask empty (as if a filter dropped every token of the step)."""

    def _loss_mask(self, batch):
        return torch.zeros_like(super()._loss_mask(batch))


def test_an_empty_step_is_skipped(tmp_path, tokenizer, dataset):
    """No loss token on any process: J = 0 and zero gradients, and the optimizer does not step, so weight
    decay and momentum leave the weights as they were (a step would move them: the control)."""
    before = {n: p.detach().clone() for n, p in tiny_model().named_parameters()}
    trainer, _ = run(GRPOTrainer, "dapo", 2, tmp_path, tokenizer, dataset, weight_decay=0.5)
    assert trainer.lossagg_skipped_steps == 0
    moved = max(float((p.detach().cpu() - before[n]).abs().max()) for n, p in trainer.model.named_parameters())
    assert moved > 1e-6, "the control step did not move the weights: the test would prove nothing"
    trainer, grads = run(EmptyStep, "dapo", 2, tmp_path, tokenizer, dataset, weight_decay=0.5)
    assert all(float(g.abs().max()) == 0.0 for g in grads.values()), "an empty step's gradient is not zero"
    assert trainer.lossagg_skipped_steps == 1
    moved = max(float((p.detach().cpu() - before[n]).abs().max()) for n, p in trainer.model.named_parameters())
    assert moved == 0.0, f"the empty step moved the weights by {moved:.3g}"


# ------------------------------------------------------------------ TRL's trainer, whole (issue 47)
@pytest.mark.parametrize("objective", ["cispo", "sapo", "vespo", "luspo"])
def test_trls_other_objectives_are_served_exactly(objective, tmp_path, tokenizer, dataset):
    """TRL's cispo, sapo, vespo and luspo per-token losses on the mode of TRL's own reducer for each: TRL's own
    gradient with one micro-batch per step, and the same with 2 and 4 accumulation steps."""
    _, one = run(GRPOTrainer, objective, 1, tmp_path, tokenizer, dataset)
    _, theirs = run(TRLGRPOTrainer, objective, 1, tmp_path, tokenizer, dataset)
    assert relative_difference(theirs, one) < 1e-9
    _, clipped = run(GRPOTrainer, "dapo", 1, tmp_path, tokenizer, dataset)
    if objective == "cispo":  # at the first step the ratio is 1, where the others' gradient is the clipped surrogate's
        assert relative_difference(one, clipped) > 1e-4, "the objective changed nothing: the test would prove nothing"
    for steps in (2, 4):
        _, split = run(GRPOTrainer, objective, steps, tmp_path, tokenizer, dataset)
        assert relative_difference(one, split) < 1e-6, steps


KL_BETA = 0.04


def test_the_kl_penalty_as_a_term_on_its_own_mode(tmp_path, tokenizer, dataset):
    """A config naming the term 'kl' (coefficient beta) reduces TRL's KL penalty on its own mode, apart from the
    policy term: the second step's gradient (the first's KL is 0 at the reference) is the same with 1 and 4
    accumulation steps, and other than with the KL inside the policy term (TRL's, whose own gradient it equals)."""
    settings = {"mode": "token_mean", "terms": {"kl": {"mode": "sample_mean", "coefficient": KL_BETA}}}
    common = {"max_steps": 2, "beta": KL_BETA, "num_iterations": 2}
    grads = {}
    for name, cls, steps, kwargs in (
        ("one", GRPOTrainer, 1, {"trainer_kwargs": {"loss_aggregation": settings}}),
        ("split", GRPOTrainer, 4, {"trainer_kwargs": {"loss_aggregation": settings}}),
        ("inside", GRPOTrainer, 1, {}),
        ("trl", TRLGRPOTrainer, 1, {}),
    ):
        second = SecondStep()
        run(cls, "dapo", steps, tmp_path, tokenizer, dataset, callbacks=(second,), **common, **kwargs)
        grads[name] = second.grads
    assert relative_difference(grads["one"], grads["split"]) < 1e-6
    assert relative_difference(grads["trl"], grads["inside"]) < 1e-9  # without the term: TRL's KL inside the per-token loss
    assert relative_difference(grads["one"], grads["inside"]) > 1e-6, "the KL term on sample_mean gave token_mean's gradient"


class SecondStep(Capture):
    """The gradient of the second optimizer step."""

    def __init__(self):
        super().__init__()
        self.seen = 0

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.seen += 1
        if self.seen == 2:
            self.grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def test_a_generation_batch_of_two_optimizer_steps(tmp_path, tokenizer, dataset):
    """steps_per_generation = 2 x gradient_accumulation_steps: one plan per optimizer step, cut from TRL's shuffled
    generation batch. Each step's gradient is the same with 1 and 2 accumulation steps; TRL's own dapo divides by
    the generation batch's tokens (num_items_in_batch rescaled), not the step's (the test prints how far off)."""
    grads = {}
    for name, cls in (("ours", GRPOTrainer), ("trl", TRLGRPOTrainer)):
        for steps in (1, 2):
            second = SecondStep()
            trainer, first = run(cls, "dapo", steps, tmp_path, tokenizer, dataset, max_steps=2, steps_per_generation=2 * steps, callbacks=(second,))
            grads[name, steps] = (first, second.grads)
            if cls is GRPOTrainer:
                assert trainer.lossagg_skipped_steps == 0
    for step in (0, 1):
        assert relative_difference(grads["ours", 1][step], grads["ours", 2][step]) < 1e-6, step
        off = relative_difference(grads["ours", 1][step], grads["trl", 1][step])
        print(f"optimizer step {step + 1} of a generation batch of two: TRL's own dapo is {off:.3%} off the step's token mean")
    assert max(relative_difference(grads["ours", 1][s], grads["trl", 1][s]) for s in (0, 1)) > 1e-4


def tiny_moe():
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(**TINY, num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.0)
    return transformers.MixtralForCausalLM(cfg)  # float32: the experts' grouped matmul takes no float64


class AuxRecorder(GRPOTrainer):
    """Keeps each micro-batch's loss, router auxiliary loss and loss tokens."""

    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        logps, entropies, aux = super()._get_per_token_logps_and_entropies(*args, **kwargs)
        if aux is not None:
            self.aux = getattr(self, "aux", []) + [aux.detach().double()]
        return logps, entropies, aux

    def _compute_loss(self, model, inputs):
        loss = super()._compute_loss(model, inputs)
        self.losses = getattr(self, "losses", []) + [loss.detach().double()]
        self.tokens = getattr(self, "tokens", []) + [float(self._loss_mask(inputs).sum())]
        return loss


def test_the_router_auxiliary_loss_weighs_each_micro_batch_by_its_tokens(tmp_path, tokenizer, dataset, monkeypatch):
    """The router's auxiliary loss, one number per micro-batch, enters the step weighted by the micro-batch's
    share of the step's loss tokens (docs/terms.md, "Scalar terms"): doubling its coefficient adds exactly
    c · aux_mb · tokens_mb / T to each micro-batch's loss. TRL weighs each micro-batch 1 / accumulation steps."""
    import lossagg.integrations.trl as adapter_module

    monkeypatch.setattr(sys.modules[__name__], "tiny_model", tiny_moe)
    runs = {}
    for coef in (0.01, 0.02):
        trainer, _ = run(AuxRecorder, "dapo", 4, tmp_path, tokenizer, dataset, router_aux_loss_coef=coef)
        runs[coef] = trainer
    a, b = runs[0.01], runs[0.02]
    assert len(a.aux) == 4 and all(float(x) > 0 for x in a.aux)
    total = sum(a.tokens)
    for i in range(4):
        torch.testing.assert_close(a.aux[i], b.aux[i], rtol=0, atol=0)  # the same micro-batch, the same router
        want = 0.01 * a.aux[i] * a.tokens[i] / total
        torch.testing.assert_close(b.losses[i] - a.losses[i], want, rtol=1e-4, atol=1e-7)  # float32 losses
    trl_weights = [0.25] * 4
    shares = [t / total for t in a.tokens]
    print(f"micro-batch token shares {[round(x, 3) for x in shares]}; TRL weighs each 0.25")
    assert max(abs(x - y) for x, y in zip(shares, trl_weights, strict=True)) > 1e-3, "equal shares: the test would not tell TRL's weights apart"
    assert adapter_module.PLAN_KEY in a._buffered_inputs[0]
    _, ours = run(GRPOTrainer, "dapo", 1, tmp_path, tokenizer, dataset, router_aux_loss_coef=0.01)
    _, theirs = run(TRLGRPOTrainer, "dapo", 1, tmp_path, tokenizer, dataset, router_aux_loss_coef=0.01)
    assert relative_difference(theirs, ours) < 1e-5  # one micro-batch per step: the step's own, TRL's too (float32)


def test_adaptive_entropy_follows_trls_controller_exactly(tmp_path, tokenizer, dataset):
    """use_adaptive_entropy: the coefficient TRL's controller sets at the end of a step applies to the whole next step,
    on the term 'entropy' (token_mean over the step). Over 3 steps the coefficients match TRL's own controller, and
    the weights after them are the same with 1 and 2 accumulation steps and TRL's with one micro-batch per step."""
    # plain SGD, so that the weights' moves are the gradients' sum (Adam's first steps hardly see their scale)
    settings = {"use_adaptive_entropy": True, "entropy_target": 5.0, "entropy_coef_delta": 0.05, "entropy_coef": 0.0, "max_steps": 3, "optim": "sgd"}
    initial = dict(tiny_model().named_parameters())

    def moves(trainer):
        return {n: p.detach().cpu() - initial[n].detach() for n, p in trainer.model.named_parameters()}

    weights, coefs = {}, {}
    for name, cls, steps in (("one", GRPOTrainer, 1), ("split", GRPOTrainer, 2), ("trl", TRLGRPOTrainer, 1)):
        trainer, _ = run(cls, "dapo", steps, tmp_path, tokenizer, dataset, **settings)
        weights[name] = moves(trainer)
        coefs[name] = (trainer.entropy_coef, trainer._last_world_entropy)
    assert coefs["one"][0] == pytest.approx(0.15) and coefs["one"][0] == coefs["trl"][0] == coefs["split"][0]
    assert coefs["one"][1] == pytest.approx(coefs["trl"][1], rel=1e-6) and coefs["one"][1] == pytest.approx(coefs["split"][1], rel=1e-9)
    assert relative_difference(weights["one"], weights["split"]) < 1e-6
    assert relative_difference(weights["trl"], weights["one"]) < 1e-6
    plain, _ = run(GRPOTrainer, "dapo", 1, tmp_path, tokenizer, dataset, max_steps=3, optim="sgd")
    assert relative_difference(weights["one"], moves(plain)) > 1e-4, "the adaptive bonus changed nothing: the test would prove nothing"
