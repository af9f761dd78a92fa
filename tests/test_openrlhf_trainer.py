"""OpenRLHF 0.11.2's own actor step with lossagg installed (lossagg.integrations.openrlhf), on 2 gloo DP ranks:

* the trainer built by OpenRLHF's ``ActorPPOTrainer.__init__`` around OpenRLHF's ``Actor`` (a tiny torch
  model: an embedding and a linear head, float64), then :func:`install`; each rank's experiences appended
  to its replay buffer (OpenRLHF's split), then what ``ppo_train`` does on CPU: a shuffling ``DataLoader``
  with the buffer's ``collate_fn``, OpenRLHF's own ``iter_grad_accum_global_norm`` (its all-reduced step
  totals) and OpenRLHF's own ``training_step`` for each of 3 micro-batches of 2 rows (one optimizer step);
* the strategy is the stand-in of tests/openrlhf_peer.py (DeepSpeed's ÷ micro-batches and DP average);
* the DP-averaged gradient is that of the float64 reference J (``lossagg.testing.reference_loss``) of
  the step's 12 rows (4 prompts of 3, each prompt's rows on both ranks), for every mode OpenRLHF's data
  holds, both ``empty_samples``, and KL and entropy as terms; OpenRLHF's logits are float32, hence 2e-5;
* with OpenRLHF's own ``loss_agg_mode`` (no lossagg config) the gradient is OpenRLHF's own (the trainer
  without lossagg) and J's with the matching alias: ``token-mean`` is ``token_mean``,
  ``seq-mean-token-mean`` is ``sample_mean`` with ``empty_samples: skip`` (OpenRLHF 0.11.2 divides by the
  step's non-empty rows over every DP rank: no mean of means);
* what the trainer cannot serve is refused by name when installed (these tests need no OpenRLHF).

Skipped, with the reason, when OpenRLHF is not importable (scripts/install_peers.sh installs it).
"""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace as NS

import pytest
import torch
from worlds import crashed, join, leave, run_world

import lossagg
from lossagg.integrations.openrlhf import OpenRLHFConfigError, config_for, install
from lossagg.testing import reference_loss

DP, MICRO, GAS, N_PER_PROMPT, PROMPT_LEN, RESPONSE_LEN, VOCAB = 2, 2, 3, 3, 3, 8, 11
ROWS = DP * MICRO * GAS  # one optimizer step
EMPTY_ROWS = (4, 9, 10, 11)  # no loss token: one row of prompt 1, all of prompt 3


def openrlhf_args(loss_agg_mode="token-mean", kl=0.0, entropy=None, **over):
    args = NS(
        actor=NS(
            eps_clip_low_high=(0.2, 0.28),
            dual_clip=None,
            loss_agg_mode=loss_agg_mode,
            policy_loss_type="ppo",
            aux_loss_coef=0.0,
            entropy_coef=entropy,
        ),
        algo=NS(
            advantage=NS(is_correction_level="off", is_correction_mode="mask", is_correction_gating="ratio", is_correction_threshold=(0.5, 5.0)),
            kl=NS(use_loss=kl > 0, init_coef=kl, estimator="k1", unbiased_gradient=False, target=None),
        ),
        train=NS(max_epochs=1, dynamic_batch_enable=False, colocate_all=False, async_enable=False),
        ds=NS(packing_samples=False, ring_attn_size=1, tensor_parallel_size=1),
        vllm=NS(sync_backend="gloo"),
        rollout=NS(n_samples_per_prompt=N_PER_PROMPT),
    )
    for path, value in over.items():
        section, name = path.split("__")
        setattr(getattr(args, section), name, value)
    return args


def rollout():
    """The step's 12 rows as OpenRLHF's experience maker leaves them (full-length sequences, masked tails)."""
    g = torch.Generator().manual_seed(0)
    sequences = torch.randint(0, VOCAB, (ROWS, PROMPT_LEN + RESPONSE_LEN), generator=g)
    lengths = torch.randint(2, RESPONSE_LEN + 1, (ROWS,), generator=g)
    mask = (torch.arange(RESPONSE_LEN)[None] < lengths[:, None]) & (torch.rand(ROWS, RESPONSE_LEN, generator=g) > 0.15)
    mask[list(EMPTY_ROWS)] = False
    old = -2 * torch.rand(ROWS, RESPONSE_LEN, generator=g, dtype=torch.float64) * mask
    base = old + 0.3 * torch.randn(ROWS, RESPONSE_LEN, generator=g, dtype=torch.float64)
    advantages = torch.randn(ROWS, 1, generator=g, dtype=torch.float64).expand(ROWS, RESPONSE_LEN) * mask
    return sequences, mask, old, base, advantages


class TinyLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.embed, self.head = torch.nn.Embedding(VOCAB, 6, dtype=torch.float64), torch.nn.Linear(6, VOCAB, dtype=torch.float64)

    def forward(self, sequences, attention_mask=None, position_ids=None):
        return Output(logits=self.head(torch.tanh(self.embed(sequences))) * 3)


class Output(dict):
    pass


def mode_config(mode, empty, **more):
    return {"mode": mode, "empty_samples": empty, **lossagg.MODES[mode].example_settings, **more}


SESSIONLESS = [m for m, spec in lossagg.MODES.items() if not spec.needs_sessions]
# (OpenRLHF's settings, the lossagg config or None for OpenRLHF's own loss_agg_mode)
CASES = [({}, mode_config(m, e)) for m in SESSIONLESS for e in ("count", "skip")]


def terms(kl=None, entropy=None, **setting):
    """Config terms for OpenRLHF's KL (coefficient 0.05) and entropy (-0.01) on one mode."""
    named = {"kl": (kl, 0.05), "entropy": (entropy, -0.01)}
    return {name: {"mode": mode, "coefficient": c, **setting} for name, (mode, c) in named.items() if mode}


CASES += [
    ({"kl": 0.05, "entropy": 0.01}, mode_config("prompt_mean", "skip", terms=terms("sample_mean", "sample_mean"))),
    ({"kl": 0.05, "entropy": 0.01}, mode_config("sample_mean", "count", terms=terms("token_mean", "token_mean"))),
    ({"kl": 0.05}, mode_config("token_mean", "count", terms=terms(kl="max_length"))),
    ({"entropy": 0.01}, mode_config("max_length", "skip", terms=terms(entropy="constant", divisor=16.0))),
]
OWN = [("token-mean", {"mode": "token_mean"}), ("seq-mean-token-mean", {"mode": "sample_mean", "empty_samples": "skip"})]


def reference_grad(model, config, settings, seqs, mask, old, base, adv):
    """dJ/dθ of the float64 reference J of the whole step: OpenRLHF's per-token PPO loss, k1 KL and entropy written out."""
    model.zero_grad()
    logits = model(seqs)["logits"][:, :-1]
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, seqs[:, 1:, None]).squeeze(-1)[:, -RESPONSE_LEN:] * mask
    ratio = (logp - old).clamp(-20, 20).exp()
    pg = -torch.min(ratio * adv, ratio.clamp(1 - 0.2, 1 + 0.28) * adv)
    values = {"pg": pg, "kl": logp - base, "entropy": -(logp_all.exp() * logp_all).sum(-1)[:, -RESPONSE_LEN:]}
    config = lossagg.LossAggregationConfig.coerce(config)
    cu, groups = torch.arange(ROWS + 1) * RESPONSE_LEN, torch.arange(ROWS) // N_PER_PROMPT
    j = 0.0
    for term in config.loss_terms:
        single = lossagg.LossAggregationConfig(mode=term.mode, divisor=term.divisor, empty_samples=config.empty_samples)
        j = j + term.coefficient * reference_loss(single, values[term.name].reshape(-1), mask.reshape(-1), cu, groups)
    j.backward()
    return [p.grad.clone() for p in model.parameters()]


def openrlhf_step(peer, ppo_actor, settings, given, rank, data, with_lossagg=True):
    """OpenRLHF's trainer (installed or not), this rank's rows appended, one optimizer step as ppo_train runs it."""
    from openrlhf.trainer.ppo_utils.experience import Experience
    from openrlhf.utils.loss_utils import iter_grad_accum_global_norm

    seqs, mask, old, base, adv = data
    args = openrlhf_args(**settings)
    strategy = peer.Strategy(args, GAS)
    actor = ppo_actor.Actor(TinyLM())
    actor.packing_samples = False  # OpenRLHF's Actor sets it only when it loads a model by name
    optim = torch.optim.SGD(actor.parameters(), lr=0.0)
    trainer = ppo_actor.ActorPPOTrainer(
        strategy, actor, None, optim, torch.optim.lr_scheduler.LambdaLR(optim, lambda _: 1.0), micro_train_batch_size=MICRO, buffer_cpu_offload=False
    )
    if with_lossagg:
        install(trainer, given)
    rows = [i for i in range(ROWS) if i % DP == rank]  # each prompt's rows on both ranks, OpenRLHF's rollout index kept
    for chunk in (rows[:3], rows[3:]):
        n = len(chunk)
        trainer.replay_buffer.append(
            Experience(
                sequences=seqs[chunk], attention_mask=torch.ones_like(seqs[chunk]), action_mask=mask[chunk],
                action_log_probs=old[chunk].float(), base_action_log_probs=base[chunk].float() if settings.get("kl") else None,
                advantages=adv[chunk].float(), index=list(chunk), info={"reward": torch.zeros(n)},
            )
        )  # fmt: skip
    loader = torch.utils.data.DataLoader(
        trainer.replay_buffer, batch_size=MICRO, shuffle=True, drop_last=True, collate_fn=trainer.replay_buffer.collate_fn,
        generator=torch.Generator().manual_seed(7 + rank),
    )  # fmt: skip
    for step, (experience, totals) in enumerate(iter_grad_accum_global_norm(loader, strategy, GAS, lambda e: e.action_mask)):
        trainer.training_step(experience, trainer.strategy.args.algo.kl.init_coef, step, totals)
    assert len(strategy.grads) == 1
    return strategy.grads[0]


def worker(rank, world, init_file, results_dir):
    failures, ran = join(rank, world, init_file)
    try:
        torch._dynamo.config.disable = True  # OpenRLHF's compute_entropy is torch.compile'd: eager on CPU
        import openrlhf_peer as peer

        ppo_actor = peer.ppo_actor()
        peer.cpu_only()
        data = rollout()
        for settings, given in CASES:
            grads = openrlhf_step(peer, ppo_actor, settings, given, rank, data)
            want = reference_grad(TinyLM(), given, settings, *data)
            for got, expected in zip(grads, want, strict=True):
                if not torch.allclose(got, expected, rtol=2e-5, atol=1e-8) or expected.abs().max() < 1e-4:
                    failures.append(f"{given}: gradient {(got - expected).abs().max():.3g} off J's (max {expected.abs().max():.3g})")
            ran += 1
        for own, alias in OWN:
            settings = {"loss_agg_mode": own, "kl": 0.05, "entropy": 0.01}
            ours = openrlhf_step(peer, ppo_actor, settings, None, rank, data)
            theirs = openrlhf_step(peer, ppo_actor, settings, None, rank, data, with_lossagg=False)
            want = reference_grad(TinyLM(), {**alias, "terms": terms("token_mean", "token_mean")}, settings, *data)
            for a, b, c in zip(ours, theirs, want, strict=True):
                if not (torch.allclose(a, b, rtol=2e-5, atol=1e-8) and torch.allclose(b, c, rtol=2e-5, atol=1e-8)):
                    failures.append(f"{own}: lossagg {(a - b).abs().max():.3g} off OpenRLHF's, OpenRLHF {(b - c).abs().max():.3g} off J's ({alias})")
            ran += 1
    except Exception as exc:
        failures.append(crashed(f"rank {rank}", exc))
    leave(results_dir, rank, ran, failures)


@pytest.mark.xdist_group("engines")
def test_openrlhfs_step_has_the_gradient_of_j(tmp_path):
    missing = [name for name in ("openrlhf", "ray", "transformers", "peft", "torchdata") if importlib.util.find_spec(name) is None]
    if missing:  # what OpenRLHF's actor module imports for real (tests/openrlhf_peer.py stands in for the rest)
        pytest.skip(f"OpenRLHF's actor trainer is not importable, {', '.join(missing)} missing (scripts/install_peers.sh installs it)")
    failures, runs = run_world(worker, DP, (), tmp_path)
    assert not failures, "\n".join(failures)[:6000]
    assert runs == DP * (len(CASES) + len(OWN))


REFUSALS = [
    ({"actor__policy_loss_type": "gspo"}, None, "actor.policy_loss_type='gspo': OpenRLHF multiplies GSPO's sequence ratio by the loss mask"),
    ({"train__dynamic_batch_enable": True}, None, "train.dynamic_batch_enable=True: lossagg plans OpenRLHF's fixed-size micro-batches"),
    ({"ds__ring_attn_size": 2}, None, "ds.ring_attn_size=2: lossagg plans"),
    ({"ds__tensor_parallel_size": 2}, None, "ds.tensor_parallel_size=2: lossagg plans"),
    ({"loss_agg_mode": "seq-mean-token-sum"}, None, "actor.loss_agg_mode='seq-mean-token-sum' is not one of OpenRLHF 0.11.2's"),
    ({"kl": 0.05}, {"terms": terms(entropy="token_mean")}, "terms (entropy): OpenRLHF's training_step computes kl beside"),
    ({"kl": 0.05}, {"terms": {"kl": {"coefficient": 0.1}}}, "terms.kl.coefficient=0.1: OpenRLHF applies its own, algo.kl.init_coef = 0.05"),
    ({"entropy": 0.01}, {"terms": terms(entropy="prompt_mean"), "n_samples_per_prompt": 3}, "terms.entropy.mode=prompt_mean: OpenRLHF reduces"),
    ({"kl": 0.05, "entropy": 0.01}, {"terms": terms("token_mean", "sample_mean")}, "terms: OpenRLHF hands its KL and entropy the same totals"),
    ({}, {"mode": "sample_mean", "weighting": "multiply"}, "weighting=multiply: OpenRLHF's experiences carry no per-sample weights"),
    ({}, {"mode": "session_mean"}, "mode=session_mean weighs each session (multi-turn trajectory) once"),
]


@pytest.mark.parametrize("settings, given, message", REFUSALS, ids=[m.split(":")[0].split("=")[0][:40] for _, _, m in REFUSALS])
def test_refused_by_name_when_installed(settings, given, message):
    settings = dict(settings)
    over = {k: settings.pop(k) for k in list(settings) if "__" in k}
    with pytest.raises(OpenRLHFConfigError, match="lossagg cannot serve this OpenRLHF trainer") as err:
        config_for(openrlhf_args(**settings, **over), given)
    assert message in str(err.value)


def test_adaptive_kl_refused_and_openrlhfs_own_modes_mapped():
    args = openrlhf_args(kl=0.05)
    args.algo.kl.target = 6.0
    with pytest.raises(OpenRLHFConfigError, match="algo.kl.target=6.0: the adaptive controller"):
        config_for(args, {"terms": {"kl": {"mode": "token_mean", "coefficient": 0.05}}})
    assert config_for(openrlhf_args("token-mean")).mode == "token_mean"
    own = config_for(openrlhf_args("seq-mean-token-mean"))
    assert (own.mode, own.empty_samples) == ("sample_mean", "skip")
