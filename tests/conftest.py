from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

import lossagg  # noqa: E402

HAS_CUDA = torch.cuda.is_available() and lossagg.built_with_cuda()
if not torch.cuda.is_available():
    _NO_CUDA = "no CUDA device"
elif not lossagg.built_with_cuda():
    _NO_CUDA = "CUDA device present but the CUDA kernels are not built (LOSSAGG_BUILD_CUDA)"
else:
    _NO_CUDA = ""
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not HAS_CUDA, reason=_NO_CUDA))]


def pytest_report_header(config):
    return f"lossagg: torch {torch.__version__}, built_with_cuda={lossagg.built_with_cuda()}, cuda available={torch.cuda.is_available()}"


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param
