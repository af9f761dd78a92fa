from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

import lossagg  # noqa: E402

# scripts/test_torch_matrix.sh runs a copy of these tests against the wheel it installed in a
# venv: lossagg must come from there, never from a checkout on the path.
_INSTALLED_UNDER = os.environ.get("LOSSAGG_TEST_INSTALLED_UNDER")
if _INSTALLED_UNDER and not os.path.realpath(lossagg.__file__).startswith(os.path.realpath(_INSTALLED_UNDER) + os.sep):
    pytest.exit(f"lossagg was imported from {lossagg.__file__}, not from {_INSTALLED_UNDER} (LOSSAGG_TEST_INSTALLED_UNDER)", returncode=3)

HAS_CUDA = torch.cuda.is_available() and lossagg.built_with_cuda()
if not torch.cuda.is_available():
    _NO_CUDA = "no CUDA device"
elif not lossagg.built_with_cuda():
    _NO_CUDA = "CUDA device present but the CUDA kernels are not built (LOSSAGG_BUILD_CUDA)"
else:
    _NO_CUDA = ""
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not HAS_CUDA, reason=_NO_CUDA))]


def pytest_configure(config):
    # pytest-xdist's mark (tests that must share one worker); known without xdist too
    config.addinivalue_line("markers", "xdist_group(name): run in one pytest-xdist worker with the group's other tests")


def pytest_report_header(config):
    where = os.path.dirname(lossagg.__file__)
    cuda = f"built_with_cuda={lossagg.built_with_cuda()}, cuda available={torch.cuda.is_available()}"
    return f"lossagg: {where}, torch {torch.__version__}, {cuda}"


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param
