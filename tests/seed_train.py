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


_PARSE = r"""
import contextlib, importlib, os, pickle, sys
adapter_parse_args = importlib.import_module(sys.argv[2]).parse_args
own_parse_args = importlib.import_module(sys.argv[3]).parse_args
# Megatron's parse_args (both trainers call it) rebuilds its dataclass flags from their source on every call
# (inspect.getsource and ast.parse of each config class): read once per class here, as the files do not change
# while the launches are parsed; the same docstrings, in a fresh dict each time
from megatron.training.argument_utils import ArgumentGroupFactory
_docstrings, _read = {}, ArgumentGroupFactory._get_field_docstrings
def _cached(self, cls):
    if cls not in _docstrings:
        _docstrings[cls] = _read(self, cls)
    return dict(_docstrings[cls])
ArgumentGroupFactory._get_field_docstrings = _cached
out = {}
# parse_args prints every argument to stdout (tens of thousands of lines over the launches): to /dev/null
devnull = open(os.devnull, "w")
for name, (through_lossagg, argv) in pickle.loads(bytes.fromhex(sys.argv[1])).items():
    sys.argv = argv
    sys.stderr.write(f"@@launch {name}\n")
    sys.stderr.flush()
    try:
        with contextlib.redirect_stdout(devnull):
            args = adapter_parse_args() if through_lossagg else own_parse_args()
    except SystemExit as exc:
        out[name] = ("exit", exc.code)
    else:
        out[name] = ("args", pickle.dumps(args))
sys.stdout.buffer.write(b"ARGS" + pickle.dumps(out))
"""


def parse_launches(launches: dict, *, env: dict, adapter: str, own: str, prelude: str = "", timeout: float = 600) -> dict:
    """Each launch's argument parsing by the trainer's own parse_args (module ``own``; lossagg's, ``adapter``, when
    the launch's bool is true), all in one subprocess of ``env`` (the trainer on its path), after ``prelude``:
    name -> ("args", pickled Namespace, stderr) or ("exit", status, stderr)."""
    import pickle
    import subprocess

    command = [sys.executable, "-c", prelude + _PARSE, pickle.dumps(launches).hex(), adapter, own]
    done = subprocess.run(command, env=env, capture_output=True, timeout=timeout)
    stderr = done.stderr.decode(errors="replace")
    assert done.returncode == 0 and b"ARGS" in done.stdout, stderr[-3000:]
    parsed = pickle.loads(done.stdout[done.stdout.index(b"ARGS") + 4 :])
    errs = {}
    for chunk in stderr.split("@@launch ")[1:]:
        name, _, text = chunk.partition("\n")
        errs[name] = text
    return {name: (kind, value, errs.get(name, "")) for name, (kind, value) in parsed.items()}


#: what both seed trainers' launches refuse alike (their launch flags are the seed's): launch name -> what the
#: message names (tests/test_miles_train.py and tests/test_slime_train.py build these launches on their own argv)
SEED_REFUSALS = {
    "zero_per_prompt": ["--n-samples-per-prompt", "got 0"],
    "legacy_flag_contradicted": ["--calculate-per-token-loss", "mode=sample_mean"],
    "unknown_mode": ["--loss-aggregation", "seq_meen"],
    "token_mean_tis_entropy": ["--use-tis", "token_mean"],
}


def checked_launches(parsed: dict) -> dict:
    """The launches a file's parse prefixed ``check:`` (its launch checks), by their own names."""
    return {name.removeprefix("check:"): value for name, value in parsed.items() if name.startswith("check:")}


def caller(depth: int = 2) -> str:
    """The file of the code ``depth`` frames up (stand-ins check who calls them)."""
    return sys._getframe(depth).f_code.co_filename.replace(os.sep, "/")


#: Responses of these lengths the test's rejection sampling drops whole (a sample left with no kept token).
REJECTED_WHOLE = (5, 9)


def rejected(response_length: int) -> torch.Tensor:
    """The tokens the test's rejection sampling drops: every third of the response, and the whole response
    when its length is one of :data:`REJECTED_WHOLE`."""
    out = torch.zeros(response_length, dtype=torch.bool)
    out[::3] = True
    if response_length in REJECTED_WHOLE:
        out[:] = True
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


def toy_ddp_model(args, cp: int, dtype: torch.dtype):
    """The toy LM wrapped in Megatron's DDP as the trainer's step takes it (the megatron on this process's path:
    miles' vendored one, or megatron-core for slime), for a launch's ``args`` and CP size: (module, model).
    Gradients reduce in float32 for a float32 model (slime's logits), in the model's dtype otherwise."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer import TransformerConfig

    tconfig = TransformerConfig(
        num_layers=1,
        hidden_size=8,
        num_attention_heads=1,
        context_parallel_size=cp,
        calculate_per_token_loss=args.calculate_per_token_loss,
        params_dtype=dtype,
    )
    ddp_config = DistributedDataParallelConfig(
        overlap_grad_reduce=False, grad_reduce_in_fp32=dtype == torch.float32, use_distributed_optimizer=False, bucket_size=None
    )
    module = ToyLM(tconfig, dtype=dtype)
    return module, DistributedDataParallel(tconfig, ddp_config, module)


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


def check_launches(got: dict, refused: dict[str, list[str]], plain_name: str, trainer: str, adapter_flags: tuple[str, ...] = ()) -> None:
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
    own |= set(adapter_flags)  # the adapter's own flags (miles: loss_aggregation_tis_denominators)
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
