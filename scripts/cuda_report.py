"""The CUDA kernels' resources as the compiler reports them, without a GPU (`make cuda-report`).

Compiles csrc/cuda/ops_cuda.cu for one architecture (default sm_90) in its own CMake tree
(build/cuda-report) with ``-Xptxas -v``, and turns ptxas's lines into a table: each
kernel, its registers, stack frame, spill stores/loads, static shared memory, and the
theoretical occupancy at the launch block size (256 threads). This is compiler output,
not a measurement.

    python scripts/cuda_report.py [--arch 9.0] [--write-docs]

--write-docs replaces the table in docs/benchmarks.md (between the cuda-report markers).
Exits non-zero when no CUDA toolkit or no CUDA build of torch is present.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
from build_plan import cmake_args, import_torch  # noqa: E402
from find_cuda_home import find_cuda_home  # noqa: E402

BLOCK_THREADS = 256  # kThreads in csrc/cuda/segment_kernels.cuh
DOCS = os.path.join(ROOT, "docs", "benchmarks.md")
BEGIN, END = "<!-- cuda-report:begin -->", "<!-- cuda-report:end -->"

# Per-SM limits of the architectures lossagg targets (CUDA occupancy calculator data).
SM_LIMITS = {
    "8.0": dict(regs=65536, threads=2048, blocks=32, smem=167936, warp_alloc=4, reg_unit=256),
    "9.0": dict(regs=65536, threads=2048, blocks=32, smem=233472, warp_alloc=4, reg_unit=256),
    "10.0": dict(regs=65536, threads=2048, blocks=32, smem=233472, warp_alloc=4, reg_unit=256),
}


def occupancy(regs: int, smem: int, arch: str) -> float:
    lim = SM_LIMITS[arch]
    warps_per_block = BLOCK_THREADS // 32
    regs_per_warp = -(-max(regs, 1) * 32 // lim["reg_unit"]) * lim["reg_unit"]
    warps_by_regs = lim["regs"] // regs_per_warp // lim["warp_alloc"] * lim["warp_alloc"]
    blocks = min(lim["blocks"], lim["threads"] // BLOCK_THREADS, warps_by_regs // warps_per_block)
    if smem:
        blocks = min(blocks, lim["smem"] // (-(-(smem + 1024) // 128) * 128))
    return blocks * warps_per_block / (lim["threads"] // 32)


def demangle(names: list[str]) -> list[str]:
    if not shutil.which("c++filt"):
        return names
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True, check=True).stdout.splitlines()
    return out if len(out) == len(names) else names


def short(name: str) -> str:
    """lossagg::cuda::segment_sum_tiles_kernel<float, c10::Half, long> -> segment_sum_tiles<float, Half, int64>."""
    name = name.split("(")[0].replace("lossagg::cuda::", "").replace("lossagg::", "").replace("c10::", "")
    name = name.replace("_kernel<", "<").replace("unsigned char", "uint8").replace("long", "int64").replace("BoolMask", "bool")
    return name.replace("void ", "").replace(" >", ">")


def parse(log: str) -> list[dict]:
    rows, current = [], None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '(\S+)' for 'sm_(\d+)'", line)
        if m:
            current = {"mangled": m.group(1), "sm": m.group(2), "stack": 0, "spill_st": 0, "spill_ld": 0, "regs": 0, "smem": 0}
            rows.append(current)
            continue
        if current is None:
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            current["stack"], current["spill_st"], current["spill_ld"] = map(int, m.groups())
        m = re.search(r"Used (\d+) registers", line)
        if m:
            current["regs"] = int(m.group(1))
            s = re.search(r"(\d+) bytes smem", line)
            current["smem"] = int(s.group(1)) if s else 0
    for row, name in zip(rows, demangle([r["mangled"] for r in rows]), strict=True):
        row["name"] = short(name)
    return rows


def table(rows: list[dict], arch: str, seconds: float) -> str:
    spills = sum(1 for r in rows if r["spill_st"] or r["spill_ld"])
    lines = [
        f"Compiler output (ptxas -v), not a measurement: {len(rows)} kernels for sm_{arch.replace('.', '')}, "
        f"{spills} with spills; theoretical occupancy at {BLOCK_THREADS} threads per block. "
        f"`make cuda-report` ({seconds:.0f} s to compile ops_cuda.cu on this machine).",
        "",
        "Kernels: `segment_sum_tiles<acc, values, mask>` and `expand_tiles<values, acc, mask>` (one each per (values, mask) pair, "
        "serving every op: rows of one [K, T] array or the terms' own, any op's coefficient), `segment_sum_fixup<reduce?, acc>`, "
        "`terms_total<acc>`.",
        "",
        "| kernel | registers | stack (B) | spill stores / loads (B) | static smem (B) | occupancy |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in sorted(rows, key=lambda r: r["name"]):
        lines.append(
            f"| `{r['name']}` | {r['regs']} | {r['stack']} | {r['spill_st']} / {r['spill_ld']} | {r['smem']} | "
            f"{occupancy(r['regs'], r['smem'], arch):.0%} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="9.0", choices=sorted(SM_LIMITS), help="CUDA architecture (default 9.0)")
    parser.add_argument("--write-docs", action="store_true", help="replace the table in docs/benchmarks.md")
    args = parser.parse_args(argv)
    torch = import_torch()
    if find_cuda_home() is None or torch.version.cuda is None:
        print("cuda-report: needs a CUDA toolkit and a CUDA build of torch", file=sys.stderr)
        return 1
    import time

    build = os.path.join(ROOT, "build", "cuda-report")
    env = dict(os.environ, TORCH_CUDA_ARCH_LIST=args.arch)
    configure = ["cmake", "-S", ROOT, "-B", build, *cmake_args(torch, True), "-DLOSSAGG_PTXAS_FLAGS=-Xptxas=-v"]
    conf = subprocess.run(configure, env=env, capture_output=True, text=True)
    if conf.returncode != 0:
        print(conf.stdout + conf.stderr, file=sys.stderr)
        return conf.returncode
    obj = "CMakeFiles/lossagg_ops.dir/csrc/cuda/ops_cuda.cu.o"
    if os.path.exists(os.path.join(build, obj)):
        os.remove(os.path.join(build, obj))
    start = time.time()
    done = subprocess.run(["cmake", "--build", build, "--target", obj], env=env, capture_output=True, text=True)
    seconds = time.time() - start
    if done.returncode != 0:
        print(done.stdout + done.stderr, file=sys.stderr)
        return done.returncode
    rows = parse(done.stdout + done.stderr)
    text = table(rows, args.arch, seconds)
    print(text)
    if args.write_docs:
        with open(DOCS) as f:
            doc = f.read()
        if BEGIN not in doc or END not in doc:
            print(f"cuda-report: {DOCS} has no {BEGIN} ... {END} section", file=sys.stderr)
            return 1
        head, rest = doc.split(BEGIN, 1)
        _, tail = rest.split(END, 1)
        with open(DOCS, "w") as f:
            f.write(f"{head}{BEGIN}\n{text}\n{END}{tail}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
