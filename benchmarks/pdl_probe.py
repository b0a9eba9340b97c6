"""Does cuBLASLt's GEMM kernel wait for a PDL producer? A correctness probe for the GPU host (sm_90+).

    python -m benchmarks.pdl_probe --out benchmarks/reports/gpu/pdl_cublas_h200

Why: our decode kernels are launched with programmatic dependent launch (kernels/pdl.py), so each may
start while its predecessor drains. The GEMMs between them go through cuBLASLt without it, so each of
a layer's four GEMM boundaries is a full drain and launch. After capture, a CUDA-graph edge into a GEMM
could be made programmatic (cuGraphAddDependencies_v2 from the trigger port). That is only safe if the
GEMM kernel executes griddepcontrol.wait before it reads its input. cuBLASLt neither documents this nor
offers a switch, and its `nvjet` kernels are not in the library's cubins under their names, so their
SASS cannot be read offline. This probe tests the behaviour instead.

Method, one CUDA graph per case: A is filled with NaN; a Triton producer launched with PDL waits for
that fill, lets its dependents launch at once, sleeps `--sleep-us`, then copies the real input into A.
It uses 8 CTAs, so the consumer's CTAs find free SMs while it sleeps. The consumer is F.linear(A, W)
through cuBLASLt. The producer -> consumer edge is made programmatic, the graph is replayed, and the
output is compared with F.linear on the real input; a consumer that reads A before waiting sees NaN.
Controls: a Triton reader that waits must pass, and one that does not must fail, or the probe could
not tell the two apart.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from benchmarks.common import environment, git_commit, write_report  # noqa: E402
from scripts.model_shapes import get_spec  # noqa: E402

ROWS = (2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)  # decode-graph buckets that use cuBLASLt
PRODUCER_CTAS = 8
_KERNEL_NODE = 0  # CU_GRAPH_NODE_TYPE_KERNEL
_PROGRAMMATIC = 1  # CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC, and CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC


class _EdgeData(ctypes.Structure):  # CUgraphEdgeData
    _fields_ = [
        ("from_port", ctypes.c_ubyte),
        ("to_port", ctypes.c_ubyte),
        ("type", ctypes.c_ubyte),
        ("reserved", ctypes.c_ubyte * 5),
    ]


class _KernelParams(ctypes.Structure):  # CUDA_KERNEL_NODE_PARAMS_v2: only func and kern are read
    _fields_ = [
        ("func", ctypes.c_void_p),
        ("dims", ctypes.c_uint * 7),
        ("params", ctypes.c_void_p),
        ("extra", ctypes.c_void_p),
        ("kern", ctypes.c_void_p),
        ("ctx", ctypes.c_void_p),
    ]


@functools.cache
def _libcuda() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def _call(fn: str, *args) -> None:
    rc = getattr(_libcuda(), fn)(*args)
    if rc != 0:
        raise RuntimeError(f"{fn} returned CUresult {rc}")


def _kernel_name(node: int) -> str | None:
    """The kernel's symbol, or None for a node that is not a kernel (a memset, a memcpy)."""
    kind = ctypes.c_int(-1)
    _call("cuGraphNodeGetType", ctypes.c_void_p(node), ctypes.byref(kind))
    if kind.value != _KERNEL_NODE:
        return None
    p, name = _KernelParams(), ctypes.c_char_p()
    _call("cuGraphKernelNodeGetParams_v2", ctypes.c_void_p(node), ctypes.byref(p))
    if p.func:
        _call("cuFuncGetName", ctypes.byref(name), ctypes.c_void_p(p.func))
    else:
        _call("cuKernelGetName", ctypes.byref(name), ctypes.c_void_p(p.kern))
    return name.value.decode()


def _full_edges(graph: int) -> list[tuple[int, int]]:
    n = ctypes.c_size_t(0)
    _call("cuGraphGetEdges_v2", ctypes.c_void_p(graph), None, None, None, ctypes.byref(n))
    src, dst, data = (ctypes.c_void_p * n.value)(), (ctypes.c_void_p * n.value)(), (_EdgeData * n.value)()
    _call("cuGraphGetEdges_v2", ctypes.c_void_p(graph), src, dst, data, ctypes.byref(n))
    return [(src[i], dst[i]) for i in range(n.value) if data[i].type == 0]


def make_programmatic(graph: int, src_prefix: str) -> list[str]:
    """Make every full edge out of a kernel whose name starts with `src_prefix` programmatic (its
    destination may launch once the source triggers); returns the destinations' kernel names."""
    done = []
    for src, dst in _full_edges(graph):
        s, d = _kernel_name(src), _kernel_name(dst)
        if s is None or d is None or not s.startswith(src_prefix):
            continue
        one_src, one_dst = (ctypes.c_void_p * 1)(src), (ctypes.c_void_p * 1)(dst)
        edge = (_EdgeData * 1)()
        _call("cuGraphRemoveDependencies_v2", ctypes.c_void_p(graph), one_src, one_dst, edge, 1)
        edge[0].from_port, edge[0].type = _PROGRAMMATIC, _PROGRAMMATIC
        _call("cuGraphAddDependencies_v2", ctypes.c_void_p(graph), one_src, one_dst, edge, 1)
        done.append(d)
    return done


@triton.jit
def _now(x):
    return tl.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer;", "=l,r", [x], dtype=tl.int64, is_pure=False, pack=1
    )


@triton.jit
def _late_copy(src, dst, n, SLEEP_NS: tl.constexpr, BLOCK: tl.constexpr):
    tl.extra.cuda.gdc_wait()  # the NaN fill before this kernel has landed
    tl.extra.cuda.gdc_launch_dependents()  # the consumer may launch from here on
    pid = tl.program_id(0)
    t0 = _now(pid)
    t = t0
    while t - t0 < SLEEP_NS:
        t = _now(pid)
    per = tl.cdiv(n, tl.num_programs(0))  # each program copies one contiguous share of the n elements
    end = tl.minimum(pid * per + per, n)
    for off in range(pid * per, end, BLOCK):
        idx = off + tl.arange(0, BLOCK)
        tl.store(dst + idx, tl.load(src + idx, mask=idx < end), mask=idx < end)


@triton.jit
def _reader(a, out, n, BLOCK: tl.constexpr, WAIT: tl.constexpr):
    if WAIT:
        tl.extra.cuda.gdc_wait()
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out + idx, tl.load(a + idx, mask=idx < n), mask=idx < n)


def case(consumer: str, m: int, n: int, k: int, sleep_us: int = 20, reps: int = 5) -> dict:
    """consumer: "gemm" (F.linear through cuBLASLt), "reader-wait" or "reader-nowait" (the controls)."""
    src = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    a = torch.empty_like(src)

    def body() -> torch.Tensor:
        a.fill_(float("nan"))
        _late_copy[(PRODUCER_CTAS,)](src, a, a.numel(), SLEEP_NS=sleep_us * 1000, BLOCK=1024, launch_pdl=True)
        if consumer == "gemm":
            return torch.nn.functional.linear(a, w)
        out = torch.empty_like(a)
        _reader[(triton.cdiv(a.numel(), 1024),)](
            a, out, a.numel(), BLOCK=1024, WAIT=consumer == "reader-wait"
        )
        return out

    want = torch.nn.functional.linear(src, w) if consumer == "gemm" else src
    body()  # compiles the Triton kernels and lets cuBLASLt pick its kernel outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph(keep_graph=True)  # keep the cudaGraph_t editable until instantiate()
    with torch.cuda.graph(graph):
        out = body()
    consumers = make_programmatic(graph.raw_cuda_graph(), "_late_copy")
    graph.instantiate()
    wrong = 0
    for _ in range(reps):
        graph.replay()
        torch.cuda.synchronize()
        wrong += int(not torch.equal(out, want))
    return {
        "consumer": consumer,
        "m": m,
        "n": n,
        "k": k,
        "kernel": ",".join(consumers),
        "wrong_replays": wrong,
        "replays": reps,
    }


def cublaslt_version() -> int | None:
    """cublasLtGetVersion() of the library this process loaded (e.g. 130100), None before any GEMM."""
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "libcublasLt.so" in line}
    return ctypes.CDLL(min(paths)).cublasLtGetVersion() if paths else None


def markdown(report: dict) -> str:
    lines = [
        f"# Does cuBLASLt's GEMM wait for a PDL producer? ({report['env']['hardware'].get('gpu')})",
        "",
        f"`{report['command']}` at commit {report['commit']}; producer sleeps {report['sleep_us']} us "
        f"after its trigger; torch {report['env']['versions'].get('torch')}, cuBLASLt {report['cublaslt']}",
        "",
        "| consumer | model | GEMM | rows | kernel | wrong replays |",
        "|---|---|---|---|---|---|",
    ]
    for r in report["cases"]:
        lines.append(
            f"| {r['consumer']} | {r.get('model', '')} | {r.get('gemm', '')} | {r['m']} | "
            f"{r['kernel']} | {r['wrong_replays']} of {r['replays']} |"
        )
    gemms = [r for r in report["cases"] if r["consumer"] == "gemm"]
    waits = {r["kernel"] for r in gemms} - {r["kernel"] for r in gemms if r["wrong_replays"]}
    lines.append(
        f"\n{len({r['kernel'] for r in gemms})} distinct GEMM kernels; "
        f"{len(waits)} waited for the producer in every case: {sorted(waits) or 'none'}."
    )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="path stem: writes STEM.json and STEM.md")
    parser.add_argument("--models", default="llama-3.1-8b,llama-3.2-1b,qwen3-0.6b")
    parser.add_argument("--sleep-us", type=int, default=20)
    args = parser.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        print("pdl_probe needs an sm_90+ CUDA GPU")
        return 2
    torch.backends.cuda.preferred_blas_library("cublaslt")  # as the engine (LoadConfig.blas_library)
    cases = [case(c, 64, 0, 4096, args.sleep_us) for c in ("reader-wait", "reader-nowait")]
    for model in args.models.split(","):
        for gemm, (n, k) in get_spec(model).fused_projections().items():
            cases += [{"model": model, "gemm": gemm, **case("gemm", m, n, k, args.sleep_us)} for m in ROWS]
    report = {
        "command": "python -m benchmarks.pdl_probe " + " ".join(sys.argv[1:]),
        "commit": git_commit(ROOT),
        "env": environment(),
        "cublaslt": cublaslt_version(),
        "sleep_us": args.sleep_us,
        "cases": cases,
    }
    write_report(args.out, report, markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
