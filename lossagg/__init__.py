"""lossagg: exact, split-invariant aggregation of per-token policy-gradient losses.

``import lossagg`` loads the native library, which registers ``torch.ops.lossagg.*``, and
the ops' fake kernels (:mod:`lossagg.ops`), so ``torch.compile`` and ``opcheck`` of
``torch.ops.lossagg.*`` work right after it, and the configuration (:mod:`lossagg.config`),
which adds its check of new modes to the registry. Other public names are loaded from their
modules on first use; where torch is not installed, the configuration (:mod:`lossagg.config`,
:mod:`lossagg.modes`) still works.

The modules form layers, bottom up; a module imports only from its own layer or the ones
before it, and never in a circle (tests/test_import_graph.py checks both against this list):

1. leaves: env, messages, dtypes, validate, _build_info
2. declarations (no torch at import): totals, denom_program, modes
3. configuration (no torch): config.errors, config.files, config.model, config.flags, config
4. native ops: _native, ops
5. planning: layout, context_parallel, samples, denominators, micro_batch, ledger, step, deferred, one_pass, sequence, testing
6. adapters: integrations, integrations.seed, integrations.verl_trainer, integrations.verl, integrations.megatron,
   integrations.trl_checks, integrations.trl, integrations.miles, integrations.slime, integrations.skyrl,
   integrations.openrlhf, integrations.areal, integrations.served
7. front ends: demo.report, demo.train, demo, cli, __main__, lossagg
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

try:
    import torch  # noqa: F401
except ModuleNotFoundError as _exc:  # config-only use without torch
    if _exc.name != "torch":
        raise
else:
    # the native library (torch.ops.lossagg.*) and, with it, the ops' fake kernels: an op
    # without its fake fails under torch.compile and FakeTensorMode
    from lossagg import ops  # noqa: F401

# the configuration, which adds its check of new modes to the registry (lossagg.modes.register_mode
# refuses a mode whose example_settings do not make a valid config): in place before any registration
from lossagg import config  # noqa: F401

# public name -> module that defines it
_EXPORTS = {
    # configuration (no torch)
    "ConfigError": "lossagg.config",
    "LossAggregationConfig": "lossagg.config",
    "add_loss_aggregation_args": "lossagg.config",
    "config_from_args": "lossagg.config",
    "MODES": "lossagg.modes",
    "ALIASES": "lossagg.modes",
    "REFUSED_NAMES": "lossagg.modes",
    "ModeSpec": "lossagg.modes",
    "DenomProduct": "lossagg.denom_program",
    "DenomInputs": "lossagg.denom_program",
    "ReferenceInputs": "lossagg.modes",
    "register_mode": "lossagg.modes",
    "unregister_mode": "lossagg.modes",
    "TOTALS": "lossagg.totals",
    "StepTotal": "lossagg.totals",
    "StepTotals": "lossagg.totals",
    # native ops and build facts
    "reduce": "lossagg.ops",
    "reduce_terms": "lossagg.ops",
    "segment_sum": "lossagg.ops",
    "built_with_cuda": "lossagg._native",
    "device_checks_enabled": "lossagg._native",
    "set_device_checks": "lossagg._native",
    "cpu_isa": "lossagg._native",
    "set_cpu_isa": "lossagg._native",
    # layouts, planning, aggregation
    "cu_seqlens_from_lengths": "lossagg.layout",
    "token_counts": "lossagg.layout",
    "StepPlan": "lossagg.step",
    "RankSamples": "lossagg.samples",
    "MicroBatch": "lossagg.micro_batch",
    "DeferredPlan": "lossagg.deferred",
    "DeferredStep": "lossagg.deferred",
    "gradient_scale": "lossagg.step",
    "aggregate": "lossagg.one_pass",
    "zigzag_local_cu_seqlens": "lossagg.context_parallel",
    "zigzag_positions": "lossagg.context_parallel",
    "zigzag_shard": "lossagg.context_parallel",
    # sequence-level objectives (GSPO, GMPO, LUSPO, CISPO)
    "SEQUENCE_OBJECTIVES": "lossagg.sequence",
    "SequenceObjective": "lossagg.sequence",
    "all_reduce_sum": "lossagg.sequence",
    "broadcast_to_tokens": "lossagg.sequence",
    "cispo_token_loss": "lossagg.sequence",
    "gmpo_token_loss": "lossagg.sequence",
    "gspo_token_loss": "lossagg.sequence",
    "luspo_token_loss": "lossagg.sequence",
    "objective_config": "lossagg.sequence",
    "sequence_loss": "lossagg.sequence",
    "sequence_mean": "lossagg.sequence",
    "sequence_sum": "lossagg.sequence",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'lossagg' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # for type checkers and IDEs: every name of _EXPORTS, from its module (tests/test_import_graph.py)
    from lossagg._native import built_with_cuda, cpu_isa, device_checks_enabled, set_cpu_isa, set_device_checks  # noqa: F401
    from lossagg.config import ConfigError, LossAggregationConfig, add_loss_aggregation_args, config_from_args  # noqa: F401
    from lossagg.context_parallel import zigzag_local_cu_seqlens, zigzag_positions, zigzag_shard  # noqa: F401
    from lossagg.deferred import DeferredPlan, DeferredStep  # noqa: F401
    from lossagg.denom_program import DenomInputs, DenomProduct  # noqa: F401
    from lossagg.layout import cu_seqlens_from_lengths, token_counts  # noqa: F401
    from lossagg.micro_batch import MicroBatch  # noqa: F401
    from lossagg.modes import ALIASES, MODES, REFUSED_NAMES, ModeSpec, ReferenceInputs, register_mode, unregister_mode  # noqa: F401
    from lossagg.one_pass import aggregate  # noqa: F401
    from lossagg.ops import reduce, reduce_terms, segment_sum  # noqa: F401
    from lossagg.samples import RankSamples  # noqa: F401
    from lossagg.sequence import (  # noqa: F401
        SEQUENCE_OBJECTIVES,
        SequenceObjective,
        all_reduce_sum,
        broadcast_to_tokens,
        cispo_token_loss,
        gmpo_token_loss,
        gspo_token_loss,
        luspo_token_loss,
        objective_config,
        sequence_loss,
        sequence_mean,
        sequence_sum,
    )
    from lossagg.step import StepPlan, gradient_scale  # noqa: F401
    from lossagg.totals import TOTALS, StepTotal, StepTotals  # noqa: F401
