"""Installing lossagg like a library: the wheel round trip, the torch check at import, and
the build's refusal of pip's build isolation."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FORWARD_BACKWARD = textwrap.dedent(
    """
    import os, sys, torch, lossagg
    print(lossagg.__file__)
    v = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0], requires_grad=True)
    m = torch.tensor([1, 1, 0, 1, 1], dtype=torch.bool)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    j = lossagg.reduce(v, m, cu_seqlens=cu, sample_denoms=torch.tensor([2.0, 4.0]))
    j.backward()
    # by hand: (1 + 2) / 2 + (4 + 5) / 4 = 3.75; dJ/dv = [1/2, 1/2, 0, 1/4, 1/4]
    assert j.item() == 3.75, j
    assert v.grad.tolist() == [0.5, 0.5, 0.0, 0.25, 0.25], v.grad
    print("ok", lossagg._native.torch_floor())
    """
)


def run(cmd, **kwargs):
    done = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    assert done.returncode == 0, f"{cmd} failed:\n{done.stdout}\n{done.stderr}"
    return done


def test_wheel_installs_and_runs_without_a_compiler(tmp_path):
    wheels = tmp_path / "dist"
    run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-q", "-w", str(wheels), ROOT], cwd=ROOT)
    (wheel,) = glob.glob(str(wheels / "lossagg-*.whl"))
    meta = run(
        [sys.executable, "-c", f"import zipfile; z = zipfile.ZipFile({wheel!r}); print(z.read('lossagg-0.1.0.dist-info/METADATA').decode())"]
    ).stdout
    # one wheel for every torch from the floor on, every Python 3 (the library links no Python)
    assert "Requires-Dist: torch>=2.10" in meta, meta
    assert os.path.basename(wheel).startswith("lossagg-0.1.0-py3-none-linux_"), wheel
    # A fresh virtualenv that sees the packages of the interpreter running this test (torch,
    # pydantic, ...), whatever that interpreter is: a plain one, a virtualenv (with or without
    # --system-site-packages) or a conda env. `venv --system-site-packages` would show the
    # *base* interpreter's packages instead, so a .pth file lists this process's package
    # folders. Those are only appended to the path: their own .pth files (lossagg's editable
    # install among them) are not run, and the venv's own site-packages, where the wheel
    # goes, comes first.
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", str(venv)])
    python = str(venv / "bin" / "python")
    venv_site = run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
    seen = [p for p in sys.path if os.path.basename(p) in ("site-packages", "dist-packages") and os.path.isdir(p)]
    with open(os.path.join(venv_site, "outer-packages.pth"), "w") as f:
        f.write("".join(p + "\n" for p in seen))
    # no compiler on the way: the wheel only unpacks
    env = dict(os.environ, PATH=f"{venv / 'bin'}:/usr/bin/false-dir", CC="false", CXX="false", CMAKE="false")
    env.pop("PYTHONPATH", None)
    run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", wheel], env=env)
    out = run([python, "-c", FORWARD_BACKWARD], cwd=str(tmp_path), env=env).stdout
    assert str(venv) in out.splitlines()[0], f"lossagg was not imported from the venv: {out}"
    assert out.splitlines()[-1] == "ok 2.10", out


def test_import_under_a_torch_below_the_floor_is_one_clear_error(tmp_path):
    import lossagg

    pkg = tmp_path / "lossagg"
    shutil.copytree(os.path.dirname(lossagg.__file__), pkg, ignore=shutil.ignore_patterns("__pycache__"))
    (pkg / "_build_info.py").write_text('TORCH_VERSION = "2.99.0"\nTORCH_FLOOR = "99.0"\nBUILT_WITH_CUDA = False\nCUDA_MAJOR = None\n')
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", "import lossagg"], capture_output=True, text=True, cwd=str(tmp_path), env=env)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"ImportError: lossagg needs torch >= 99.0, but this process runs torch {torch.__version__}"), done.stderr
    assert "pip install 'torch>=99.0'" in last, last
    assert "undefined symbol" not in done.stderr


BUILD_CHECKS = [
    # (what the library was built with, the torch of the process, the start of the error or None)
    ("floor_met", dict(TORCH_FLOOR="2.10"), ("2.10.0+cu128", "12.8"), None),
    ("newer_torch", dict(TORCH_FLOOR="2.10"), ("2.15.0+cu132", "13.2"), None),
    ("cpu_local_tag", dict(TORCH_FLOOR="2.10"), ("2.14.1+cpu", None), None),
    ("dev_build", dict(TORCH_FLOOR="2.10"), ("2.16.0.dev20261201", None), None),
    ("below_floor", dict(TORCH_FLOOR="2.10"), ("2.9.1", "12.8"),
     "lossagg needs torch >= 2.10, but this process runs torch 2.9.1: pip install 'torch>=2.10'"),
    ("minor_compared_as_number", dict(TORCH_FLOOR="2.10"), ("2.9.0", None), "lossagg needs torch >= 2.10"),
    ("cuda_same_major", dict(TORCH_FLOOR="2.10", BUILT_WITH_CUDA=True, CUDA_MAJOR=13), ("2.15.0+cu132", "13.2"), None),
    ("cuda_other_major", dict(TORCH_FLOOR="2.10", BUILT_WITH_CUDA=True, CUDA_MAJOR=13), ("2.10.0+cu128", "12.8"),
     "lossagg's native library holds CUDA kernels for CUDA 13, but this process runs a CUDA 12.8 build of torch"),
    ("cuda_kernels_cpu_torch", dict(TORCH_FLOOR="2.10", BUILT_WITH_CUDA=True, CUDA_MAJOR=12), ("2.14.1+cpu", None),
     "lossagg's native library holds CUDA kernels for CUDA 12, but this process runs a CPU-only build of torch"),
    ("cpu_library_any_cuda", dict(TORCH_FLOOR="2.10", BUILT_WITH_CUDA=False, CUDA_MAJOR=None), ("2.12.1+cu128", "12.8"), None),
    ("before_the_stable_abi", dict(), ("2.14.1", None), "lossagg's native library was built by an older lossagg for torch 2.14.1 only"),
]  # fmt: skip


@pytest.mark.parametrize(("case", "built", "running", "error"), BUILD_CHECKS, ids=[c[0] for c in BUILD_CHECKS])
def test_the_import_check_compares_the_floor_and_the_cuda_major(case, built, running, error):
    """The torch floor and the CUDA major version decide, never the full version string (a
    +cpu or +cu132 tag, or a newer release, loads); every refusal names a remedy."""
    from types import SimpleNamespace

    from lossagg import _native

    info = SimpleNamespace(TORCH_VERSION="2.14.1", BUILT_WITH_CUDA=False, CUDA_MAJOR=None)
    for key, value in built.items():
        setattr(info, key, value)
    if error is None:
        _native._check_build(info, *running)
        return
    with pytest.raises(ImportError) as exc:
        _native._check_build(info, *running)
    message = str(exc.value)
    assert message.startswith(error), message
    assert "pip install" in message, message


def test_missing_build_is_one_clear_error(tmp_path):
    import lossagg

    pkg = tmp_path / "lossagg"
    shutil.copytree(os.path.dirname(lossagg.__file__), pkg, ignore=shutil.ignore_patterns("__pycache__", "*.so", "_build_info.py"))
    done = subprocess.run(
        [sys.executable, "-c", "import lossagg"], capture_output=True, text=True, cwd=str(tmp_path), env=dict(os.environ, PYTHONPATH=str(tmp_path))
    )
    assert done.returncode != 0
    assert "ImportError: lossagg's native library" in done.stderr and "is not built" in done.stderr, done.stderr


@pytest.mark.parametrize(
    ("torch_stub", "expected"),
    [
        ("sys.modules['torch'] = None", "pip install --no-build-isolation"),  # isolation hid torch
        (
            "import types; t = types.ModuleType('torch'); t.__file__ = '/tmp/pip-build-env-x/overlay/lib/torch/__init__.py'; "
            "t.__version__ = '2.99.0'; sys.modules['torch'] = t",
            "lives in pip's isolated build environment",
        ),
    ],
)
def test_build_under_isolation_stops_at_once(torch_stub, expected):
    code = f"import sys; {torch_stub}; sys.path.insert(0, 'scripts'); import build_plan; build_plan.check_build_isolation()"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode != 0 and expected in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_cpu_only_configure_needs_no_cuda_toolkit(tmp_path):
    """A CUDA build of torch on a machine without a CUDA toolkit: the CPU-only build's CMake
    step (what setup.py runs) still configures, since it does not use torch's CMake package."""
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import build_plan

    cmake = shutil.which("cmake")
    if cmake is None:
        pytest.skip("cmake is not installed")
    args = build_plan.cmake_args(torch, False)
    env = dict(os.environ, PATH=os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if not os.path.exists(os.path.join(p, "nvcc"))))
    env.pop("CUDA_HOME", None)
    done = subprocess.run(
        [cmake, "-S", ROOT, "-B", str(tmp_path / "b"), *args, "-DCUDAToolkit_ROOT=/nonexistent", "-DCUDA_TOOLKIT_ROOT_DIR=/nonexistent"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def test_the_library_imports_no_cpp_symbol_of_torch():
    """On the LibTorch stable ABI, the library needs only torch's C functions (aoti_torch_*,
    torch_*): a C++ symbol of c10/ATen/torch would tie it to one torch release again."""
    import lossagg

    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm (binutils) is not installed")
    lib = os.path.join(os.path.dirname(lossagg.__file__), "liblossagg_ops.so")
    undefined = run([nm, "-D", "--undefined-only", "--demangle", lib]).stdout.splitlines()
    cpp = [line for line in undefined if any(ns in line for ns in ("c10::", "at::", "torch::", "caffe2::"))]
    assert not cpp, "\n".join(cpp[:20])
    shims = [line.split()[-1] for line in undefined if line.split()[-1].startswith(("aoti_torch_", "torch_"))]
    assert shims, "the library should call torch's stable C shims"
    needed = run(["readelf", "-d", lib]).stdout if shutil.which("readelf") else ""
    assert "libpython" not in needed and "libtorch_python" not in needed, needed
