from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

import tiers  # noqa: E402

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


def _xdist_groups_hold() -> bool:
    """Whether pytest-xdist's ``--dist loadgroup`` can name a test's group: it sets ``item._nodeid``, which a test's
    ``nodeid`` returns up to pytest 9.1 (pytest 9.2 derives it from elsewhere, and the groups are silently lost)."""
    from _pytest import nodes

    probe = object.__new__(nodes.Node)
    probe._nodeid = "test@group"
    try:
        return probe.nodeid == "test@group"
    except Exception:
        return False


def pytest_configure(config):
    if getattr(config.option, "dist", "no") == "loadgroup" and not _xdist_groups_hold():
        raise pytest.UsageError(
            f"--dist loadgroup: pytest {pytest.__version__} ignores the node ids pytest-xdist sets for xdist_group, so the "
            "groups' tests would spread over the workers (each paying their set-up): install pytest<9.2 (scripts/setup.sh does)"
        )
    # pytest-xdist's mark (tests that must share one worker); known without xdist too
    config.addinivalue_line("markers", "xdist_group(name): run in one pytest-xdist worker with the group's other tests")
    config.addinivalue_line("markers", "full_tier: run in the full tier only (LOSSAGG_TEST_TIER=full; tests/tiers.py)")


@pytest.hookimpl(trylast=True)  # after pytest-xdist's own, which names each test's group
def pytest_collection_modifyitems(config, items):
    """The default tier leaves out the tests marked full_tier (tests/tiers.py), as deselected. Under pytest-xdist's
    ``--dist loadgroup`` every test of an ``xdist_group`` must carry its group (its worker pays the group's set-up once
    and runs its process worlds one at a time; pytest_configure refuses a pytest that would lose the groups)."""
    if not tiers.FULL:
        left = [item for item in items if item.get_closest_marker("full_tier") is not None]
        if left:
            config.hook.pytest_deselected(items=left)
            items[:] = [item for item in items if item.get_closest_marker("full_tier") is None]


def pytest_report_header(config):
    where = os.path.dirname(lossagg.__file__)
    cuda = f"built_with_cuda={lossagg.built_with_cuda()}, cuda available={torch.cuda.is_available()}"
    return f"lossagg: {where}, torch {torch.__version__}, {cuda}; test tier: {tiers.TIER}"


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param
