"""What the tests of the seed's two trainers (miles: tests/test_miles_train.py, slime: tests/test_slime_train.py)
share to run a trainer's own training step on the CPU: the toy model, the optimizer and scheduler stand-ins its
``train_one_step`` calls, the test's rejection sampling and TIS function, small helpers."""

from __future__ import annotations

import os
import sys

import torch

VOCAB, HIDDEN, PROMPT_LEN = 7, 4, 3


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
