"""OpenRLHF 0.11.2's actor trainer on CPU, for tests/test_openrlhf_trainer.py; scripts/install_peers.sh installs
OpenRLHF with --no-deps and checks it with :func:`ppo_actor`.

Every stand-in is here, each narrow:

* imports the training step never uses, as modules whose every name fails when called: ``deepspeed``
  (the engine; the step reaches it only through the strategy), ``flash_attn`` (packed sequences and ring
  attention), ``vllm`` and ``pylatexenc`` (generation and math grading); the packages ``openrlhf.trainer``
  and ``openrlhf.trainer.ray`` are entered without their ``__init__``, which import the vLLM engines;
* :class:`Strategy`, the smallest stand-in for OpenRLHF's ``DeepspeedStrategy`` that ``training_step``
  calls: ``backward`` divides the loss by ``accumulated_gradient`` as DeepSpeed's engine does, and at
  every ``accumulated_gradient``-th ``optimizer_step`` the gradients are averaged over the DP ranks (a
  gloo all-reduce) and kept (the weights do not move); no DP mesh (OpenRLHF's totals then use the
  default group). A real DeepSpeed 0.19.6 engine on its CPU accelerator took 2 min 15 s to start two
  gloo ranks on this machine and refuses float64 gradients ("unsupported grad type"), so it is not used;
* :func:`cpu_only`: ``torch.cuda.current_device`` (the replay buffer's target device, never used with
  ``buffer_cpu_offload`` off) and ``torch.cuda.synchronize`` (after the trainer's barrier) on a CPU build.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import os
import sys

import torch

STUBBED = ("deepspeed", "deepspeed.runtime", "deepspeed.runtime.zero", "deepspeed.runtime.zero.partition_parameters",
           "flash_attn", "flash_attn.bert_padding", "flash_attn.utils", "flash_attn.utils.distributed", "vllm", "pylatexenc")  # fmt: skip


class Absent:
    """A name of a stubbed module: fails when the step calls it."""

    def __init__(self, name):
        self.name = name

    def __call__(self, *args, **kwargs):
        raise AssertionError(f"{self.name} is a stand-in (tests/openrlhf_peer.py): the training step was not expected to call it")

    def __getattr__(self, name):
        return Absent(f"{self.name}.{name}")


def _stub(name: str) -> None:
    try:
        importlib.import_module(name)
        return  # installed: the real one
    except ImportError:
        pass
    module = importlib.util.module_from_spec(importlib.machinery.ModuleSpec(name, None, is_package=True))

    def attribute(attr, _name=name):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return Absent(f"{_name}.{attr}")

    module.__getattr__ = attribute
    sys.modules[name] = module


def _bare(package: str, folder: str) -> None:
    if package not in sys.modules:
        spec = importlib.machinery.ModuleSpec(package, None, is_package=True)
        spec.submodule_search_locations = [folder]
        sys.modules[package] = importlib.util.module_from_spec(spec)


def ppo_actor():
    """OpenRLHF's ``openrlhf.trainer.ray.ppo_actor`` module; ImportError when OpenRLHF or an import it needs is missing."""
    import openrlhf

    for name in STUBBED:
        _stub(name)
    root = os.path.dirname(openrlhf.__file__)
    _bare("openrlhf.trainer", os.path.join(root, "trainer"))
    _bare("openrlhf.trainer.ray", os.path.join(root, "trainer", "ray"))
    return importlib.import_module("openrlhf.trainer.ray.ppo_actor")


def cpu_only() -> None:
    torch.cuda.current_device = lambda: 0
    torch.cuda.synchronize = lambda *args: None


class Strategy:
    """See the module docstring: DeepSpeed's ÷ accumulated_gradient and DP average, the gradient kept at each step."""

    ds_device_mesh = None
    ring_attn_group = None

    def __init__(self, args, accumulated_gradient: int):
        self.args, self.accumulated_gradient, self.micro_steps, self.grads = args, accumulated_gradient, 0, []

    def backward(self, loss, model, optimizer, **kwargs):
        (loss / self.accumulated_gradient).backward()

    def optimizer_step(self, optimizer, model, scheduler, name="model", **kwargs):
        self.micro_steps += 1
        if self.micro_steps % self.accumulated_gradient:
            return
        grads = []
        for p in model.parameters():
            g = p.grad.clone()
            torch.distributed.all_reduce(g)
            grads.append(g / torch.distributed.get_world_size())
            p.grad = None
        self.grads.append(grads)

    def get_grad_norm(self, model):
        return 0.0

    def is_rank_0(self):
        return torch.distributed.get_rank() == 0
