"""verl 0.9.1's own training engine with lossagg's actor loss: ``FSDPEngineWithLMHead.forward_backward_batch``
(FSDP2, gloo on CPU, a tiny randomly initialised Llama) splits one mini-batch into 1, 2 or 4 micro-batches
(``micro_batch_size_per_gpu``) or by tokens (``use_dynamic_bsz``) and runs its own forward, lossagg's loss
and backward on each; the model's gradient after the mini-batch must not move with the split, on DP 1 and
DP 2, and must equal the gradient of the same objective written with verl's own reducers.

What runs on CPU needs, in each spawned rank only:

* verl's platform plug-in (``verl.plugin.platform.set_platform``) with a CPU platform: verl's built-in ones
  are CUDA, NPU and ROCm, and ``get_device_id()`` would otherwise call ``torch.cuda.current_device()``;
* ``strategy="fsdp2"``: FSDP1 refuses CPU modules with ``sync_module_states=True``, which verl always sets;
* ``sys.modules["trl"] = None``: with trl importable, verl's ``apply_monkey_patch`` imports
  ``AutoModelForCausalLMWithValueHead``, which trl 1.x no longer has (it patches the value-head model's
  ``state_dict`` only, which an actor never uses);
* ``use_remove_padding=False`` with eager attention (the packed path needs flash-attention) and fp32
  mixed precision (no CPU bf16 autocast).
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys

import pytest
import torch
from tiers import full_tier

pytest.importorskip("verl")
pytest.importorskip("tensordict")
pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
pytest.importorskip("peft", reason="verl's FSDP engine imports peft (verl/utils/fsdp_utils.py)")

from worlds import report, run_world  # noqa: E402

N, P, R, VOCAB = 8, 4, 6, 32  # samples of the mini-batch, prompt and response widths, vocabulary
KL_COEF, ENTROPY_COEFF = 0.05, 0.01
AGGREGATION = {"mode": "sample_mean", "terms": {"kl": {"mode": "token_mean", "coefficient": KL_COEF}}}
TOLERANCE = 1e-5  # fp32 model: relative to the gradient's largest entry


def save_tiny_model(path: str) -> None:
    """A 2-layer Llama with random weights and a WordLevel tokenizer built here (no hub)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel(vocab={"<pad>": 0, **{f"t{i}": i for i in range(1, VOCAB)}}, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="t1", bos_token="t2", unk_token="<pad>")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=1,
    )
    LlamaForCausalLM(config).save_pretrained(path)
    fast.save_pretrained(path)


def use_cpu_platform() -> None:
    """verl's platform plug-in with the CPU: set before verl's engine module is imported (it reads the device name then)."""
    from verl.plugin.platform import PlatformBase, set_platform

    class CPUPlatform(PlatformBase):
        device_name = "cpu"
        vendor_name = "cpu"
        device_module = torch.cpu

        def is_available(self):
            return True

        def current_device(self):
            return "cpu"

        def device_count(self):
            return 1

        def set_device(self, device_index):
            pass

        def synchronize(self, device_index=None):
            pass

        def manual_seed(self, seed):
            torch.manual_seed(seed)

        def manual_seed_all(self, seed):
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings):
            pass

        def empty_cache(self):
            pass

        def get_device_capability(self, device_index=0):
            return (None, None)

        def communication_backend_name(self):
            return "gloo"

        def visible_devices_envvar(self):
            return "CUDA_VISIBLE_DEVICES"

        def nvtx_range(self, msg):
            return contextlib.nullcontext()

        def profiler_start(self):
            pass

        def profiler_stop(self):
            pass

        def ray_resource_name(self):
            return "CPU"

        def ray_noset_envvars(self):
            return []

        def is_ipc_supported(self):
            return False

        def cudart(self):
            return None

    set_platform(CPUPlatform())


def build_engine(model_path: str):
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    model = HFModelConfig(
        path=model_path, override_config={"attn_implementation": "eager"}, use_remove_padding=False, enable_gradient_checkpointing=False
    )
    engine = FSDPEngineConfig(
        strategy="fsdp2",
        use_remove_padding=False,
        use_torch_compile=False,
        mixed_precision={"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"},
    )
    optimizer = FSDPOptimizerConfig(lr=1e-3, total_training_steps=1)
    built = FSDPEngineWithLMHead(model_config=model, engine_config=engine, optimizer_config=optimizer, checkpoint_config=CheckpointConfig())
    built.initialize()
    return built


def mini_batch(rows: list[int], carried=None):
    """The mini-batch's ``rows`` as verl's trainer hands them to its engine (``_update_actor``): left-padded
    prompts, right-padded responses with holes in the loss mask and one empty response, converted by
    ``left_right_2_no_padding``, with the step's global batch size (and the rows of what lossagg's driver
    plan added to the batch, ``carried``, with each row's place in the step, ``row``)."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    g = torch.Generator().manual_seed(1)
    prompt_lengths = torch.randint(1, P + 1, (N,), generator=g)
    lengths = torch.randint(1, R + 1, (N,), generator=g)
    lengths[2], lengths[5] = 0, R
    in_prompt = torch.arange(P)[None] >= (P - prompt_lengths)[:, None]
    in_response = torch.arange(R)[None] < lengths[:, None]
    prompts = torch.where(in_prompt, torch.randint(3, VOCAB, (N, P), generator=g), 0)
    responses = torch.where(in_response, torch.randint(3, VOCAB, (N, R), generator=g), 0)
    attention = torch.cat([in_prompt, in_response], 1).long()
    step = {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], 1),
        "attention_mask": attention,
        "position_ids": (attention.cumsum(1) - 1).clamp(min=0),
        "response_mask": (in_response & (torch.rand(N, R, generator=g) > 0.2)).long(),
        "old_log_probs": -3.4 + 0.3 * torch.randn(N, R, generator=g),
        "ref_log_prob": -3.4 + 0.3 * torch.randn(N, R, generator=g),
        "advantages": torch.randn(N, 1, generator=g).expand(N, R).clone(),
    }
    step["row"] = torch.arange(N)
    step.update(carried or {})
    index = torch.tensor(rows)
    data = left_right_2_no_padding(TensorDict({k: v[index] for k, v in step.items()}, batch_size=[len(rows)]))
    tu.assign_non_tensor(data, calculate_entropy=True, global_batch_size=N, temperature=1.0, use_remove_padding=False, use_fused_kernels=False)
    return data


def actor_config(**kw):
    from verl.workers.config import FSDPActorConfig, PolicyLossConfig

    settings = {"entropy_coeff": ENTROPY_COEFF, "use_kl_loss": True, "kl_loss_coef": KL_COEF, "kl_loss_type": "k1", **kw}
    return FSDPActorConfig(
        strategy="fsdp2",
        ppo_mini_batch_size=N,
        ppo_micro_batch_size_per_gpu=2,
        rollout_n=1,
        policy_loss=PolicyLossConfig(loss_mode="vanilla"),
        **settings,
    )


def verls_reference(config, model_output, data, dp_group=None):
    """The same objective with verl's own reducers and the step totals its engine hands over: verl's ppo_loss
    with seq-mean-token-mean (pg and entropy over the global batch size) and no KL, plus KL by verl's global
    token-mean (over batch_num_tokens)."""
    from verl.trainer.ppo.core_algos import agg_loss, kl_penalty
    from verl.workers.utils.losses import ppo_loss
    from verl.workers.utils.padding import no_padding_2_padding

    loss, metrics = ppo_loss(config, model_output, data, dp_group)
    padded = data.select("response_mask", "ref_log_prob").to_padded_tensor()
    log_prob = no_padding_2_padding(model_output["log_probs"], data)
    kl = kl_penalty(logprob=log_prob, ref_logprob=padded["ref_log_prob"], kl_penalty="k1")
    step = {"dp_size": data["dp_size"], "batch_num_tokens": data["batch_num_tokens"], "global_batch_size": data["global_batch_size"]}
    return loss + KL_COEF * agg_loss(loss_mat=kl, loss_mask=padded["response_mask"].to(bool), loss_agg_mode="token-mean", **step), metrics


def counted(fn, sizes: list[int]):
    """``fn`` as verl's engine calls it, recording each micro-batch's size (the split really happened)."""

    def loss_function(model_output, data, dp_group=None):
        sizes.append(len(data))
        return fn(model_output=model_output, data=data, dp_group=dp_group)

    return loss_function


def gradient(engine, loss_fn, rows, carried=None, **split) -> tuple[torch.Tensor, list[int]]:
    """One mini-batch through the engine's forward_backward_batch: the full gradient (DP-averaged by FSDP) and the micro-batch sizes."""
    from verl.utils import tensordict_utils as tu

    data = mini_batch(rows, carried)
    tu.assign_non_tensor(data, **split)
    sizes: list[int] = []
    with engine.train_mode():
        engine.optimizer_zero_grad()
        engine.forward_backward_batch(data, counted(loss_fn, sizes))
        grad = torch.cat([p.grad.full_tensor().reshape(-1) for p in engine.module.parameters()]).clone()
    return grad, sizes


def splits(world: int) -> dict[str, dict]:
    per_rank = N // world
    fixed = {
        f"{per_rank // size} micro-batch(es)": {"use_dynamic_bsz": False, "micro_batch_size_per_gpu": size}
        for size in (per_rank, per_rank // 2, per_rank // 4)
    }
    return {**fixed, "dynamic bsz": {"use_dynamic_bsz": True, "max_token_len_per_gpu": 20}}


def _world(rank, world, model_path, init_file, results_dir):
    """One rank of DP ``world``: the gradients of every split (and of verl's reference) saved for the test to compare."""
    sys.modules["trl"] = None  # see the module's docstring: verl's monkey patch cannot import trl 1.x's value-head model
    os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    torch.set_num_threads(1)
    import torch.distributed as dist

    use_cpu_platform()
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    failures, ran = [], 0
    try:
        from lossagg.integrations.verl import actor_loss

        engine = build_engine(model_path)
        rows = list(range(rank * N // world, (rank + 1) * N // world))  # the trainer dispatches each DP rank its chunk
        ours = actor_loss(actor_config(), AGGREGATION)
        results = {}
        for name, split in splits(world).items():
            results[name] = gradient(engine, ours, rows, **split)
        whole = {"use_dynamic_bsz": False, "micro_batch_size_per_gpu": N // world}
        results["verl's reducers"] = gradient(
            engine, functools.partial(verls_reference, actor_config(use_kl_loss=False, loss_agg_mode="seq-mean-token-mean")), rows, **whole
        )
        # where verl's own mode is lossagg's (every term sample_mean = seq-mean-token-mean): verl's ppo_loss as it is
        results["lossagg sample_mean"] = gradient(engine, actor_loss(actor_config(), {"mode": "sample_mean"}), rows, **whole)
        from verl.workers.utils.losses import ppo_loss

        results["verl seq-mean-token-mean"] = gradient(
            engine, functools.partial(ppo_loss, actor_config(loss_agg_mode="seq-mean-token-mean")), rows, **whole
        )
        results.update(planned_prompt_mean(engine, rows, world))
        if rank == 0:
            torch.save({k: (g, sizes) for k, (g, sizes) in results.items()}, os.path.join(results_dir, f"grads_dp{world}.pt"))
        ran = len(results)
    except Exception as e:  # reported, not lost in the spawn
        import traceback

        failures.append(f"rank {rank}: {e!r}\n{traceback.format_exc()}")
    finally:
        report(results_dir, rank, ran, failures)
        dist.destroy_process_group()


# ------------------------------------------------------------------ prompt groups, planned on verl's driver
GROUPS = torch.arange(N) // 2  # verl's uid: four prompts of rollout.n = 2
PLANNED = {"mode": "prompt_mean", "empty_samples": "skip", "terms": {"kl": {"mode": "session_mean", "coefficient": KL_COEF}}}


def driver_plan(aggregation) -> dict[str, torch.Tensor]:
    """What lossagg_trainer's driver adds to verl's batch of the whole step (one mini-batch of N rows over DP 2)."""
    import numpy as np
    from verl import DataProto
    from verl.utils import tensordict_utils as tu

    from lossagg.integrations.verl_trainer import DENOMS_KEY, plan_batch

    whole = mini_batch(list(range(N)))
    mask = tu.get(whole, "response_mask").to_padded_tensor(0) if whole["response_mask"].is_nested else whole["response_mask"]
    batch = DataProto.from_dict(tensors={"response_mask": mask}, non_tensors={"uid": np.array([f"p{int(g)}" for g in GROUPS], dtype=object)})
    plan_batch(batch, aggregation, mini_batch_size=N, dp_size=2)
    return {DENOMS_KEY: batch.batch[DENOMS_KEY]}


def reference_j(config, model_output, data, dp_group=None):
    """The unsplit float64 J of ``PLANNED`` (lossagg.testing's reference, docs/modes.md) over all N samples, with this
    micro-batch's per-token losses in their rows and the other rows' held at 0: J is linear in them, so its gradient
    is this micro-batch's share of J's (times DP, which FSDP's average divides away). verl's vanilla loss per token
    with its clips out of reach (clip_ratio, its low and high bounds and clip_ratio_c 1e9): -A · ratio; KL k1: log_prob - ref_log_prob."""
    from verl.workers.utils.padding import no_padding_2_padding

    import lossagg
    from lossagg.testing import reference_loss

    log_prob = no_padding_2_padding(model_output["log_probs"], data).to(torch.float64)
    padded = data.select("response_mask", "old_log_probs", "advantages", "ref_log_prob").to_padded_tensor()
    rows, width = data["row"], log_prob.shape[1]
    whole = mini_batch(list(range(N)))
    mask = whole.select("response_mask").to_padded_tensor()["response_mask"].to(torch.float64)
    pg = torch.zeros(N, mask.shape[1], dtype=torch.float64)
    kl = torch.zeros_like(pg)
    pg[rows, :width] = -padded["advantages"].to(torch.float64) * torch.exp(log_prob - padded["old_log_probs"].to(torch.float64))
    kl[rows, :width] = log_prob - padded["ref_log_prob"].to(torch.float64)
    cu = torch.arange(N + 1) * mask.shape[1]
    sessions = torch.arange(N)  # one trajectory, one sample (verl's agent loop)
    j = reference_loss(lossagg.LossAggregationConfig(mode="prompt_mean", empty_samples="skip"), pg.reshape(-1), mask.reshape(-1), cu, GROUPS)
    j_kl = reference_loss(
        lossagg.LossAggregationConfig(mode="session_mean", empty_samples="skip"), kl.reshape(-1), mask.reshape(-1), cu, session_index=sessions
    )
    return (j + KL_COEF * j_kl).to(torch.float32) * int(data["dp_size"]), {}


def planned_prompt_mean(engine, rows, world) -> dict:
    """``PLANNED`` through verl's engine with the step planned on the driver, split as ``splits`` splits it, and
    the unsplit float64 J's gradient (one micro-batch per rank)."""
    import functools

    from lossagg.integrations.verl import actor_loss

    unclipped = actor_config(entropy_coeff=0.0, clip_ratio=1e9, clip_ratio_low=1e9, clip_ratio_high=1e9, clip_ratio_c=1e9)
    ours = actor_loss(unclipped, PLANNED, planned=True)
    carried = driver_plan(ours.keywords["aggregation"])
    out = {f"planned {name}": gradient(engine, ours, rows, carried, **split) for name, split in splits(world).items()}
    whole = {"use_dynamic_bsz": False, "micro_batch_size_per_gpu": N // world}
    out["J"] = gradient(engine, functools.partial(reference_j, unclipped), rows, carried, **whole)
    return out


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.fixture(scope="session")  # once per worker: xdist interleaves files, which would redo a module fixture
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    save_tiny_model(str(path))
    return str(path)


@pytest.mark.xdist_group("engines")
# the default tier runs DP 2 (tests/tiers.py)
@pytest.mark.parametrize("world", [pytest.param(1, marks=full_tier), 2])
def test_verl_engine_gradient_does_not_move_with_the_micro_batch_split(world, model_path, tmp_path):
    """verl's FSDP2 engine on DP ``world``: lossagg's loss (pg and entropy sample_mean, KL token_mean) gives the
    same gradient whether the engine splits the mini-batch into 1, 2 or 4 micro-batches or by tokens, equal to
    the objective written with verl's reducers; with every term sample_mean it is verl's seq-mean-token-mean."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    failures, runs = run_world(_world, world, (model_path,), tmp_path)
    assert not failures, "\n".join(failures)
    results = torch.load(tmp_path / f"grads_dp{world}.pt")
    assert runs == world * len(results)
    want, _ = results["verl's reducers"]
    per_rank = N // world
    for name in splits(world):
        grad, sizes = results[name]
        print(f"DP {world}, lossagg, {name} {sizes}: gradient off verl's reducers by {relative(grad, want):.3g} (norm {float(grad.norm()):.4g})")
    same, verls = results["lossagg sample_mean"][0], results["verl seq-mean-token-mean"][0]
    print(f"DP {world}, lossagg sample_mean vs verl's ppo_loss seq-mean-token-mean: {relative(same, verls):.3g}")
    print(f"DP {world}, KL token_mean vs KL sample_mean (the config's term mode shows): {relative(same, want):.3g}")
    for name in splits(world):
        grad, sizes = results[name]
        assert sum(sizes) == per_rank
        assert relative(grad, want) < TOLERANCE, f"{name}: gradient off verl's reducers by {relative(grad, want):.3g}"
    assert [len(results[name][1]) for name in list(splits(world))[:3]] == [1, 2, 4]
    assert len(results["dynamic bsz"][1]) > 1
    assert relative(same, verls) < TOLERANCE
    assert relative(same, want) > 100 * TOLERANCE
    j = results["J"][0]
    for name in splits(world):
        grad, sizes = results[f"planned {name}"]
        print(f"DP {world}, planned prompt_mean (skip) + KL session_mean, {name} {sizes}: off the float64 J's gradient by {relative(grad, j):.3g}")
        assert relative(grad, j) < TOLERANCE, f"planned {name}: off J's gradient by {relative(grad, j):.3g}"
    assert relative(j, want) > 100 * TOLERANCE  # prompt groups weigh otherwise than sample_mean
