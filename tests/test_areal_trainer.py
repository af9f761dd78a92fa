"""AReaL 1.0.4's own FSDP engine and PPO actor with lossagg's actor engine (lossagg.integrations.areal), on CPU:

* two gloo ranks (DP 2), AReaL's ``FSDPPPOActor`` subclassed by ``lossagg_actor`` and built by its own
  ``__init__``, ``create_process_group`` and ``initialize`` (FSDP2 over a tiny random Qwen2, float32, sdpa),
  then AReaL's own ``PPOActor.ppo_update`` on each rank's trajectory dicts (2 prompt groups of 3 rows, one group
  and two rows without a loss token): its mini-batch split (``ppo_n_minibatches``), the engine's ``train_batch``
  with its micro-batches (one row each, ``max_tokens_per_mb``: CPU attention over a packed micro-batch does not stop at
  the rows' boundaries), its all-reduced loss weight and scale, FSDP's gradient average and its optimizer step (lr 0);
* the gradient of every step is that of the float64 reference J (``lossagg.testing.reference_loss``) of the
  step's rows on both ranks, with AReaL's PPO-clip loss of each token written out: every mode without sessions,
  the session modes with ``sessions=True`` (each trajectory dict one session), both ``empty_samples``, the
  entropy and KL terms, two optimizer steps per ``ppo_update``;
* AReaL's own actor (``PPOActor``, its token mean) and the lossagg actor left at its default (``token_mean``)
  give the same gradient; what the actor cannot serve is refused by name when it is built.

The rollout is given (advantages, old log-probabilities and the reference's as AReaL's ``compute_advantages``
leaves them), not generated: no inference engine runs. ``TORCHDYNAMO_DISABLE=1`` in the ranks: AReaL compiles
its log-probability and entropy kernels with ``torch.compile``, seconds per rank on CPU, and the eager kernels
compute the same. Skipped, with the reason, when AReaL's FSDP engine is not importable (scripts/install_peers.sh
installs AReaL and its import-time needs).
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

import lossagg
from lossagg.testing import reference_loss

if importlib.util.find_spec("areal") is None:  # found, not imported: AReaL's import takes ~10 s, paid in the ranks only
    pytest.skip("AReaL is not importable (scripts/install_peers.sh installs it)", allow_module_level=True)

from worlds import crashed, join, leave, run_world  # noqa: E402

VOCAB, WIDTH, ROWS, DICTS, DP = 32, 10, 3, 4, 2  # 4 trajectory dicts (prompt groups) of 3 rows, 2 per rank
EMPTY_ROWS, EMPTY_DICT = (4,), 3  # rows 4 (rank 0) and all of dict 3 (rank 1) hold no loss token
TERMS = {"entropy": {"mode": "sample_mean", "coefficient": -0.01}, "kl": {"mode": "token_mean", "coefficient": 0.05}}
F64 = torch.float64


def save_tiny_model(path: str) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
        max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    Qwen2ForCausalLM(config).save_pretrained(path)


def rollout(model):
    """Every trajectory dict, as AReaL's ``compute_advantages`` leaves them (rolled loss mask and old log-probs)."""
    g = torch.Generator().manual_seed(7)
    dicts = []
    for d in range(DICTS):
        lengths = torch.full((ROWS,), WIDTH)  # one length: AReaL's token-balanced splits then cut every rank alike
        attention = torch.ones(ROWS, WIDTH, dtype=torch.bool)
        ids = torch.randint(1, VOCAB, (ROWS, WIDTH), generator=g)
        prompt = torch.randint(2, 5, (ROWS, 1), generator=g)
        mask = ((torch.arange(WIDTH)[None] >= prompt - 1) & (torch.arange(WIDTH)[None] < WIDTH - 1)).float()  # response, rolled by one
        mask *= (torch.rand(ROWS, WIDTH, generator=g) > 0.15).float()
        for r in range(ROWS):
            if d == EMPTY_DICT or d * ROWS + r in EMPTY_ROWS:
                mask[r] = 0
        logp, _ = token_logp_entropy(model, ids, lengths)
        old = (logp.detach() + 0.3 * torch.randn(ROWS, WIDTH, generator=g, dtype=F64)).float() * mask
        ref = (logp.detach() + 0.3 * torch.randn(ROWS, WIDTH, generator=g, dtype=F64)).float() * mask
        dicts.append(
            dict(
                input_ids=ids, attention_mask=attention, loss_mask=mask, logprobs=old, prox_logp=old.clone(), ref_logp=ref,
                advantages=torch.randn(ROWS, WIDTH, generator=g) * mask, rewards=torch.randn(ROWS, generator=g),
                kl_rewards=torch.zeros(ROWS, WIDTH), tot_rewards=torch.zeros(ROWS, WIDTH),
                test_row=torch.arange(d * ROWS, (d + 1) * ROWS)[:, None].expand(ROWS, WIDTH).contiguous(),
            )
        )  # fmt: skip
    return dicts


def token_logp_entropy(model, ids, lengths):
    """Each row's log-probability of its next token and entropy at each position (0 past the row), as AReaL's engine."""
    logp, entropy = torch.zeros(ids.shape, dtype=F64), torch.zeros(ids.shape, dtype=F64)
    for r, n in enumerate(lengths.tolist()):
        logits = model(ids[r : r + 1, :n]).logits[0].to(F64).log_softmax(-1)
        logp[r, : n - 1] = logits[:-1].gather(-1, ids[r, 1:n, None])[:, 0]
        entropy[r, :n] = -(logits.exp() * logits).sum(-1)
    return logp, entropy


def reference_j(model, dicts, rows, config, kl_estimator, sessions):
    """J of one step's rows (global ids), float64, AReaL's PPO-clip (eps 0.2) of each token written out."""
    batch = {k: torch.cat([d[k] for d in dicts])[rows] for k in ("input_ids", "attention_mask", "loss_mask", "prox_logp", "ref_logp", "advantages")}
    lengths = batch["attention_mask"].sum(-1)
    logp, entropy = token_logp_entropy(model, batch["input_ids"], lengths)
    ratio, adv = torch.exp(logp - batch["prox_logp"].to(F64)), batch["advantages"].to(F64)
    per_token = {"pg": torch.max(-adv * ratio, -adv * ratio.clamp(0.8, 1.2)), "entropy": entropy}
    per_token["kl"] = kl_estimator(logp, batch["ref_logp"].to(F64)).to(F64)
    keep = batch["attention_mask"]
    cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0))
    groups = torch.as_tensor(rows) // ROWS
    j = torch.zeros((), dtype=F64)
    for name, coefficient in (("pg", 1.0), *((n, t.coefficient) for n, t in config.terms.items())):
        mode = config.mode if name == "pg" else config.terms[name].mode
        settings = {"mode": mode, "empty_samples": config.empty_samples, **lossagg.MODES[mode].example_settings}
        if name == "pg":
            settings = {k: v for k, v in config.model_dump().items() if k != "terms"}
        term = lossagg.LossAggregationConfig.from_dict(settings)
        sessions_of = groups if sessions else None
        j = j + coefficient * reference_loss(term, per_token[name][keep], batch["loss_mask"][keep], cu, groups, session_index=sessions_of)
    return j


def cases():
    """(name, lossagg config ("areal": AReaL's own actor, None: the adapter's default), sessions, ppo_n_minibatches)."""
    out = [("areal-own", "areal", False, 1), ("lossagg-default", None, False, 1)]  # AReaL's PPOActor; the adapter left at its default
    for mode, spec in lossagg.MODES.items():
        for empty in ("count", "skip"):
            out.append((f"{mode}-{empty}", {"mode": mode, "empty_samples": empty, **spec.example_settings}, spec.needs_sessions, 1))
    out.append(("prompt_mean-terms-count", {"mode": "prompt_mean", "terms": TERMS}, False, 1))
    out.append(("session_mean-terms-skip", {"mode": "session_mean", "empty_samples": "skip", "terms": TERMS}, True, 1))
    out.append(("sample_mean-two-steps", {"mode": "sample_mean"}, False, 2))
    return out


REFUSALS = [
    ({"m2_threshold": 0.04}, {}, "actor.m2_threshold=0.04: M2PO drops tokens inside the loss"),
    ({}, {"mode": "token_mean", "terms": {"nll": {"coefficient": 1.0}}}, "terms (nll): AReaL's engine hands the loss function"),
    ({}, {"mode": "sample_mean", "weighting": "multiply"}, "weighting=multiply needs per-sample weights, which AReaL's batch does not carry"),
    ({}, {"mode": "session_mean"}, "mode=session_mean weighs each session (multi-turn trajectory) once"),
]


def _world(rank, world, model_path, init_file, results_dir):
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world), TORCHDYNAMO_DISABLE="1")
    failures, ran = join(rank, world, init_file)
    try:
        import torch.distributed as dist
        from areal.api.cli_args import MicroBatchSpec, OptimizerConfig, PPOActorConfig
        from areal.api.io_struct import FinetuneSpec
        from areal.engine.fsdp_engine import FSDPPPOActor
        from areal.trainer.ppo.actor import PPOActor
        from areal.utils.data import KLEstimator
        from transformers import Qwen2ForCausalLM

        from lossagg.integrations.areal import AReaLConfigError, config_for, lossagg_actor

        class Recording(FSDPPPOActor):  # the test's: each optimizer step's gradient and rows, after AReaL's own train_batch
            def train_batch(self, input_, loss_fn, loss_weight_fn):
                stats = super().train_batch(input_, loss_fn, loss_weight_fn)
                rows = [None] * world
                dist.all_gather_object(rows, input_["test_row"][:, 0].tolist())
                grads = {n: p.grad.full_tensor().clone() for n, p in self.model.named_parameters()}
                self.steps.append((sum(rows, []), grads, stats["num_micro_batches"]))
                return stats

        def actor_config(**settings):
            return PPOActorConfig(
                experiment_name="lossagg", trial_name="areal", path=model_path, attn_impl="sdpa", dtype="float32", backend=f"fsdp:d{world}",
                optimizer=OptimizerConfig(lr=0.0, weight_decay=0.0, gradient_clipping=1e10), mb_spec=MicroBatchSpec(max_tokens_per_mb=WIDTH),
                recompute_logprob=False, use_decoupled_loss=False, eps_clip=0.2, **settings,
            )  # fmt: skip

        cfg = actor_config()
        engine = lossagg_actor(Recording)(config=cfg)
        lossagg_cls = type(engine.actor)
        engine.create_process_group()
        engine.initialize(None, FinetuneSpec(total_train_epochs=1, dataset_size=DICTS * ROWS, train_batch_size=DICTS * ROWS))
        model = Qwen2ForCausalLM.from_pretrained(model_path, dtype=F64, attn_implementation="eager")
        dicts = rollout(model)
        kl_estimator = KLEstimator(cfg.kl_estimator)
        grads = {}
        for name, given, sessions, minibatches in cases():
            ran += 1
            cfg.ppo_n_minibatches = minibatches
            config = config_for(cfg, None if given == "areal" else given, sessions=sessions)
            engine.actor = PPOActor(cfg, engine) if given == "areal" else lossagg_cls(cfg, engine, config)
            engine.steps = []
            engine.actor.ppo_update([{k: v.clone() for k, v in d.items()} for d in dicts[rank * 2 : rank * 2 + 2]])
            assert len(engine.steps) == minibatches and all(n == 2 * ROWS // minibatches for *_, n in engine.steps), name
            grads[name] = engine.steps[-1][1]
            for rows, got, _ in engine.steps:
                j = reference_j(model, dicts, rows, config, kl_estimator, sessions)
                want = torch.autograd.grad(j, [model.get_parameter(n) for n in got])
                for (param, g), w in zip(got.items(), want, strict=True):
                    scale = max(float(w.abs().max()), 1e-6)
                    if not torch.allclose(g.to(F64), w, rtol=1e-4, atol=2e-5 * scale):
                        failures.append(f"{name}: {param} differs from J's gradient by {float((g.to(F64) - w).abs().max()):.3g} (max {scale:.3g})")
                        break
        same = all(torch.allclose(grads["areal-own"][n], grads["lossagg-default"][n], rtol=1e-5, atol=1e-8) for n in grads["areal-own"])
        if not same:
            failures.append("AReaL's own actor and lossagg's default (token_mean) give different gradients")
        if rank == 0:
            for settings, given, message in REFUSALS:
                ran += 1
                try:
                    config_for(actor_config(**settings), given)
                    failures.append(f"{settings} {given} was accepted")
                except AReaLConfigError as err:
                    if message not in str(err) or "lossagg cannot serve this AReaL actor" not in str(err):
                        failures.append(f"{given}: {err}")
    except Exception as exc:  # noqa: BLE001 - the rank reports it
        failures.append(crashed(f"rank {rank}", exc))
    leave(results_dir, rank, ran, failures)


@pytest.mark.xdist_group("engines")
def test_areal_fsdp_engine_step_has_the_gradient_of_j(tmp_path):
    model_path = str(tmp_path / "model")
    save_tiny_model(model_path)
    failures, runs = run_world(_world, DP, (model_path,), tmp_path)
    assert not failures, "\n".join(failures)
    assert runs == DP * len(cases()) + len(REFUSALS)
