"""CPU stand-ins for the CUDA calls Megatron makes on the way, shared by the engine tests that drive a
real Megatron schedule on CPU (tests/test_megatron_engine.py with megatron-core, tests/test_miles_train.py
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


def caller_file(depth: int = 2) -> str:
    """The file of the code that called the stand-in."""
    import os
    import sys

    return sys._getframe(depth).f_code.co_filename.replace(os.sep, "/")


def install_megatron_core_stand_ins() -> dict:
    """megatron-core's three CUDA calls on the way of a schedule with DDP, on the CPU: ``torch.cuda.current_device``
    (grad buffer allocation) and ``torch.cuda.current_stream`` (waits on CUDA-graph events, none on CPU), each
    only from param_and_grad_buffer.py, and the schedule's ``torch.zeros(..., device="cuda")`` token total.
    Returns their use counts."""
    import megatron.core.pipeline_parallel.schedules as schedules

    used = {"current_device": 0, "current_stream": 0, "zeros": 0}
    buffer = "megatron/core/distributed/param_and_grad_buffer.py"

    def current_device():
        if not caller_file().endswith(buffer):
            raise StandInMisuse(f"torch.cuda.current_device stand-in called from {caller_file()}")
        used["current_device"] += 1
        return "cpu"

    class _NoEvents:
        def wait_event(self, event):
            raise StandInMisuse("a CUDA-graph event to wait on: not expected on CPU")

    def current_stream(*args, **kwargs):
        if not caller_file().endswith(buffer):
            raise StandInMisuse(f"torch.cuda.current_stream stand-in called from {caller_file()}")
        used["current_stream"] += 1
        return _NoEvents()

    torch.cuda.current_device = current_device
    torch.cuda.current_stream = current_stream
    schedules.torch = TorchForSchedules(used)
    return used
