"""CPU stand-ins for the CUDA calls Megatron makes on the way, shared by the engine tests that drive a
real Megatron schedule on CPU (tests/test_engine_megatron.py with megatron-core, tests/test_integration_miles.py
with miles' vendored copy). Each is narrow: it serves the one call it is for and fails the test otherwise."""

from __future__ import annotations

import torch


class StandInMisuse(AssertionError):
    pass


class TorchForSchedules:
    """A schedules.py module's ``torch``, with ``zeros(..., device="cuda")`` (the schedule's token
    total, a 0-dim int tensor) made on the CPU; ``used["zeros"]`` counts the calls."""

    def __init__(self, used: dict):
        self._used = used

    def __getattr__(self, name):
        return getattr(torch, name)

    def zeros(self, *args, **kwargs):
        if kwargs.get("device") == "cuda":
            if kwargs.get("dtype") != torch.int or tuple(args[0]) != ():
                raise StandInMisuse(f"schedules.py asked for zeros{args} {kwargs}: only the token total is expected")
            self._used["zeros"] += 1
            kwargs["device"] = "cpu"
        return torch.zeros(*args, **kwargs)
