"""What the tests of the seed's two trainers (miles: tests/test_miles_train.py, slime: tests/test_slime_train.py)
share to run a trainer's own training step on the CPU: the toy model, the optimizer and scheduler stand-ins its
``train_one_step`` calls, the test's rejection sampling and TIS function, small helpers."""

from __future__ import annotations

import argparse
import os
import sys

import torch

VOCAB, HIDDEN, PROMPT_LEN = 7, 4, 3


#: What the trainers' parse_args leaves for a launch without lossagg's flags (the attributes lossagg reads or sets).
LAUNCH_DEFAULTS = {
    **dict.fromkeys(("loss_aggregation_divisor", "loss_aggregation_empty_samples", "loss_aggregation_config", "loss_aggregation_term")),
    **dict.fromkeys(("num_steps_per_rollout", "custom_loss_function_path", "custom_pg_loss_reducer_function_path")),
    "calculate_per_token_loss": False,
    "loss_type": "policy_loss",
}


def launch_args(mode=None, n=4, gbs=16, **more) -> argparse.Namespace:
    """A parsed launch of miles or slime with ``--loss-aggregation mode``, ``n`` samples per prompt and a global
    batch of ``gbs``; ``more`` sets the trainer's other attributes (its hooks' paths, its terms' flags)."""
    return argparse.Namespace(**{**LAUNCH_DEFAULTS, "loss_aggregation": mode, "n_samples_per_prompt": n, "global_batch_size": gbs, **more})


def caller(depth: int = 2) -> str:
    """The file of the code ``depth`` frames up (stand-ins check who calls them)."""
    return sys._getframe(depth).f_code.co_filename.replace(os.sep, "/")


def rejected(response_length: int) -> torch.Tensor:
    """The tokens the test's rejection sampling drops: every third of the response."""
    out = torch.zeros(response_length, dtype=torch.bool)
    out[::3] = True
    return out


def rejecting_tis_function(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, **kwargs):
    """A TIS/RS function in the trainers' signature (``--custom-tis-function-path``): truncated importance
    weights on pg_loss, and modified masks (every third response token dropped), as their TIS/RS functions
    hand back ``modified_response_masks``."""
    weights = torch.clamp(torch.exp(torch.cat(train_log_probs) - torch.cat(rollout_log_probs)), min=args.tis_clip_low, max=args.tis_clip)
    modified = [m * (~rejected(m.numel())).to(m.dtype) for m in loss_masks]
    return pg_loss * weights, modified, {}


def without(argv, flag):
    """A launch's argv without ``flag`` and its value."""
    i = argv.index(flag)
    return argv[:i] + argv[i + 2 :]


class ToyLM(torch.nn.Module):
    """Logits of each token from its own embedding (no attention, so a CP shard needs no exchange)."""

    def __init__(self, config=None, dtype=torch.float64):
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.config = config
        if config is not None:
            from megatron.core.enums import ModelType

            self.model_type = ModelType.encoder_or_decoder
        self.embed = torch.nn.Parameter(torch.randn(VOCAB, HIDDEN, generator=g, dtype=torch.float64).to(dtype))
        self.head = torch.nn.Parameter((torch.randn(HIDDEN, VOCAB, generator=g, dtype=torch.float64) * 0.5).to(dtype))

    def set_input_tensor(self, input_tensor):
        """One pipeline stage: nothing comes."""

    def forward(self, input_ids, *args, **kwargs):
        return self.embed[input_ids] @ self.head


class RecordingOptimizer:
    """What the trainers' train_one_step calls of an optimizer; step() records every parameter's main_grad."""

    def __init__(self, module):
        self.module = module
        self.grads = []
        self.param_groups = [{"lr": 0.0}]

    def scale_loss(self, loss):
        return loss

    def zero_grad(self):
        pass

    def prepare_grads(self):
        return False

    def get_grad_norm(self):
        return 0.0

    def step(self):
        self.grads.append([p.main_grad.detach().clone() for p in (self.module.embed, self.module.head)])
        return True, 0.0, None


class Scheduler:
    def step(self, increment):
        pass

    def get_lr(self, param_group):
        return param_group["lr"]


def check_launches(got: dict, refused: dict[str, list[str]], plain_name: str, trainer: str) -> None:
    """What a trainer's own parse_args made of the launches (``got``: name -> ("args", pickled Namespace, stderr)
    or ("exit", status, stderr)): each of ``refused`` ends with exit status 2 and one ``error:`` line naming
    every needle, never a traceback; with no lossagg flag the launch is the trainer's own (``plain_name``),
    attribute for attribute, lossagg's flags aside."""
    import pickle

    for name, needles in refused.items():
        kind, value, stderr = got[name]
        assert (kind, value) == ("exit", 2), f"{name}: expected exit status 2, got {kind if kind == 'args' else value}: {stderr[-1500:]}"
        line = next((ln for ln in stderr.splitlines() if ln.startswith("error: ")), "")
        assert all(n in line for n in needles), f"{name}: {line!r} should name {needles}"
        assert "Traceback" not in stderr, f"{name}: a traceback on the launch: {stderr[-2000:]}"
    plain, through = (pickle.loads(got[k][1]) for k in (plain_name, "no_flag_through_lossagg"))
    own = {"loss_aggregation", "loss_aggregation_divisor", "loss_aggregation_empty_samples", "loss_aggregation_config", "loss_aggregation_term"}
    assert set(vars(through)) - set(vars(plain)) == own
    differ = {k for k in vars(plain) if vars(plain)[k] != vars(through)[k]}
    assert not differ, f"with no lossagg flag the launch must be {trainer}'s own, attribute for attribute; differ: {sorted(differ)}"
    assert all(vars(through)[k] is None for k in own)


def launches_file(parsed: dict, tmp_path_factory, trainer: str) -> str:
    """Each launch's pickled Namespace, as the trainer's own parse_args made it (every launch parsed), in a file
    the spawned ranks read."""
    import pickle

    out = {}
    for name, (kind, value, stderr) in parsed.items():
        assert kind == "args", f"{name}: the launch exited with {value}: {stderr[-3000:]}"
        out[name] = value
    path = tmp_path_factory.mktemp(trainer) / "launches.pkl"
    path.write_bytes(pickle.dumps(out))
    return str(path)
