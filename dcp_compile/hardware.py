"""Hardware profiles the planner prices a program on: one dataclass per profile, as data.

Every number of a vendor profile carries its source (``sources``: field -> where it was
read). A number no source we could read gives is ``None`` and its source says so; the
planner then leaves that term out of the prediction and says which (``Prediction.unpriced``),
never a silent guess.

``this-machine`` is measured, not looked up: :func:`calibrate` runs micro-benchmarks once
(memory bandwidth by a large tensor copy, peak FLOPs by a matmul, the eager per-op cost, and
collective latency and bandwidth over the threaded world and over gloo) and caches them in
``~/.cache/dcp_compile/hardware.json`` (``DCP_COMPILE_CACHE`` overrides the directory).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from dcp_compile.runtime.errors import DCPInputError

GB = 1e9
GIB = 2**30
TB = 1e12


@dataclass(frozen=True)
class HardwareProfile:
    """One chip (or, for ``this-machine``, one rank thread) and the links between chips."""

    name: str
    memory_bytes: float | None        # device memory per chip
    memory_bandwidth: float | None    # bytes/s, device memory per chip
    link_bandwidth: float | None      # bytes/s per chip, one direction, to its peers
    link_latency: float | None        # seconds per collective, independent of its size
    peak_flops: float | None          # dense FLOP/s at the model's 16-bit dtype (fp32 here)
    # Eager execution: seconds of dispatch per graph op (0: a compiled graph, no per-op cost
    # modelled), and whether ranks are threads sharing one host (memory bandwidth and, the
    # GIL, op dispatch serialise across ranks).
    op_overhead: float = 0.0
    shared_host: bool = False
    # Cores of the shared host: min(ranks, cores) rank threads run their kernels at once
    # (op dispatch, under the GIL, does not overlap). None: not a shared host.
    cores: int | None = None
    # bytes/s at which the attention kernel reads KV; None: memory_bandwidth (a kernel that
    # reads the KV once, as fused decode attention kernels do).
    kv_bandwidth: float | None = None
    sources: dict = field(default_factory=dict)   # field -> source (URL, or how measured)

    def to_json(self) -> dict:
        return asdict(self)


# Vendor sources, read with the project's search tool (docs/planner.md "Hardware profiles").
_TRN2 = ("https://awsdocs-neuron.readthedocs-hosted.com/en/latest/about-neuron/arch/"
         "neuron-hardware/trainium2.html (aws-neuron-sdk trainium2.rst)")
_H200_MLPERF = ("https://github.com/mlcommons/inference_results_v4.1/blob/main/closed/NVIDIA/"
                "systems/H200-SXM-141GBx8_TRT_MaxQ.json")
_H200_BW = "https://aiwiki.ai/wiki/nvidia_h200 (141 GB HBM3e at 4.8 TB/s, citing NVIDIA)"
_H200_FLOPS = ("https://huggingface.co/datasets/devidasmishra/ai-inference-hardware-economics"
               "-2026 (H200 SXM5 fp16 dense 989 TFLOPS; NVIDIA's sheet lists 1,979 with "
               "sparsity)")
_B200_MLPERF = ("https://github.com/mlcommons/inference_results_v6.0/blob/main/closed/Nebius/"
                "systems/nebius_b200_n1.json (NVIDIA B200-SXM-180GB)")
_B200_VULTR = "https://docs.vultr.com/inference-cookbook/cuda/getting-started/hardware-overview"
_B200_FLOPS = ("https://glennklockwood.com/garden/processors/B200 (HGX B200 at 1,000 W: "
               "BF16 2,250 dense TFLOPS, citing NVIDIA's Blackwell datasheet)")
_MI355X = ("https://aiwiki.ai/wiki/amd_instinct_mi355x (288 GB HBM3E, 8 TB/s; AMD Instinct "
           "MI355X, CDNA 4)")
_MI355X_NO_LINK = ("not found: the pages read give a per-link Infinity Fabric figure (~153 GB/s "
                   "bidirectional, https://humeconsulting.co/amd-mi355x-strong-node-level-"
                   "inference-but-not-yet-rack-scale), not a chip's bandwidth to its 7 peers")
_MI355X_NO_FLOPS = ("not found: the pages read give FP4 (10 PFLOPS) and FP8 (5 PFLOPS) peaks, "
                    "not a dense BF16 figure")
_H20 = ("https://willitrunai.com/es/gpus/h20-96gb (96 GB HBM3 at 4.0 TB/s, 148 TFLOPS FP16, "
        "NVLink 4.0 900 GB/s)")
_NO_LATENCY = ("not found: no vendor sheet we could read gives a collective latency; the "
               "latency term is left out of the prediction")

PROFILES: dict[str, HardwareProfile] = {
    "trainium2": HardwareProfile(
        name="trainium2", memory_bytes=96 * GIB, memory_bandwidth=2.9 * TB,
        # 1.28 TB/s NeuronLink-v3 per chip; the sheet does not say per direction: halved.
        link_bandwidth=1.28 * TB / 2, link_latency=None, peak_flops=667e12,
        sources={"memory_bytes": _TRN2, "memory_bandwidth": _TRN2,
                 "link_bandwidth": _TRN2 + " (1.28 TB/s per chip, taken as both directions)",
                 "link_latency": _NO_LATENCY, "peak_flops": _TRN2 + " (BF16 dense)"}),
    "h200": HardwareProfile(
        name="h200", memory_bytes=141 * GB, memory_bandwidth=4.8 * TB,
        link_bandwidth=450 * GB, link_latency=None, peak_flops=989e12,
        sources={"memory_bytes": _H200_MLPERF, "memory_bandwidth": _H200_BW,
                 "link_bandwidth": _H200_MLPERF + " (NVLink 900 GB/s bidirectional)",
                 "link_latency": _NO_LATENCY, "peak_flops": _H200_FLOPS}),
    "b200": HardwareProfile(
        name="b200", memory_bytes=180 * GB, memory_bandwidth=8.0 * TB,
        link_bandwidth=900 * GB, link_latency=None, peak_flops=2250e12,
        sources={"memory_bytes": _B200_MLPERF, "memory_bandwidth": _B200_VULTR,
                 "link_bandwidth": _B200_VULTR + " (NVLink 5 1.8 TB/s bidirectional)",
                 "link_latency": _NO_LATENCY, "peak_flops": _B200_FLOPS}),
    "mi355x": HardwareProfile(
        name="mi355x", memory_bytes=288 * GB, memory_bandwidth=8.0 * TB,
        link_bandwidth=None, link_latency=None, peak_flops=None,
        sources={"memory_bytes": _MI355X, "memory_bandwidth": _MI355X,
                 "link_bandwidth": _MI355X_NO_LINK, "link_latency": _NO_LATENCY,
                 "peak_flops": _MI355X_NO_FLOPS}),
    # The 96 GB H20. The H20-3e (141 GB HBM3e) has no bandwidth figure in the pages read.
    "h20": HardwareProfile(
        name="h20", memory_bytes=96 * GB, memory_bandwidth=4.0 * TB,
        link_bandwidth=450 * GB, link_latency=None, peak_flops=148e12,
        sources={"memory_bytes": _H20, "memory_bandwidth": _H20,
                 "link_bandwidth": _H20 + " (900 GB/s bidirectional: 450 one way)",
                 "link_latency": _NO_LATENCY, "peak_flops": _H20 + " (FP16 dense)"}),
}

THIS_MACHINE = "this-machine"
HARDWARE_NAMES = (THIS_MACHINE, *PROFILES)


def profile(name_or_profile, *, calibrate_now: bool = True) -> HardwareProfile:
    """The profile called ``name`` (a HardwareProfile passes through); ``this-machine``
    from the cache, calibrated first when there is none (``calibrate_now``)."""
    if isinstance(name_or_profile, HardwareProfile):
        return name_or_profile
    if name_or_profile == THIS_MACHINE:
        cached = _read_cache()
        if cached is not None:
            return cached
        if not calibrate_now:
            raise DCPInputError(f"{THIS_MACHINE} is not calibrated yet (no "
                                f"{cache_path()}). Run dcp_compile.hardware.calibrate().")
        return calibrate()
    if name_or_profile not in PROFILES:
        raise DCPInputError(f"unknown hardware {name_or_profile!r}. Use one of "
                            f"{list(HARDWARE_NAMES)}, or pass a HardwareProfile.")
    return PROFILES[name_or_profile]


def cache_path() -> Path:
    base = os.environ.get("DCP_COMPILE_CACHE") or Path.home() / ".cache" / "dcp_compile"
    return Path(base) / "hardware.json"


def _read_cache() -> HardwareProfile | None:
    path = cache_path()
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    return HardwareProfile(**data)


# -- calibration of this machine --------------------------------------------------------------

def calibrate(*, gloo: bool = True, write: bool = True) -> HardwareProfile:
    """Measure this machine and cache the profile. Each number is a median of repeats; the
    machine may be shared, so the cache records the load average it was measured under."""
    import torch
    host_bytes = _host_memory_bytes()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)    # a rank thread runs its ops on one intra-op thread
    try:
        bw = _copy_bandwidth(torch)
        flops = _matmul_flops(torch)
        op = _op_overhead(torch)
        step_op, kv_bw = _program_probe(torch)
    finally:
        torch.set_num_threads(threads)
    lat, link = _threaded_collectives(CALIBRATION_RANKS)
    sources = {
        "memory_bytes": "measured: MemTotal of /proc/meminfo (shared by every rank thread)",
        "memory_bandwidth": "measured: median of 64 MiB float32 tensor copies (read + write)",
        "link_bandwidth": f"measured: all_reduce of 4 MiB on a threaded world of "
                          f"{CALIBRATION_RANKS} ranks",
        "link_latency": f"measured: all_reduce of 4 bytes on a threaded world of "
                        f"{CALIBRATION_RANKS} ranks",
        "peak_flops": "measured: 512x512 float32 matmul on one intra-op thread",
        "kv_bandwidth": (f"measured: the same program's step at context {PROBE_CONTEXT} "
                         f"against 16: extra KV bytes over extra seconds (the eager "
                         f"live-span attention kernel, several passes over the KV)"),
        "op_overhead": (f"measured: a 1-rank decode step of the demo model at context 16 "
                        f"over its graph's ops ({step_op * 1e6:.1f} us per op; a bare "
                        f"torch.add costs {op * 1e6:.1f} us: the graph's custom ops run "
                        f"several aten ops each)"),
        "cores": "measured: os.cpu_count()",
        "load_average": f"{os.getloadavg()[0]:.1f} over 1 min at calibration",
    }
    if gloo:
        try:
            g_lat, g_bw = _gloo_collectives()
            sources["gloo"] = (f"measured: 2 processes over gloo: latency {g_lat * 1e6:.0f} us, "
                               f"all_reduce bandwidth {g_bw / GB:.2f} GB/s (not used by the "
                               f"threaded world's prediction)")
        except Exception as e:     # noqa: BLE001 - reported in the profile, never hidden
            sources["gloo"] = f"not measured: {type(e).__name__}: {e}"
    prof = HardwareProfile(name=THIS_MACHINE, memory_bytes=host_bytes, memory_bandwidth=bw,
                           link_bandwidth=link, link_latency=lat, peak_flops=flops,
                           op_overhead=step_op, kv_bandwidth=kv_bw, shared_host=True,
                           cores=os.cpu_count(), sources=sources)
    if write:
        path = cache_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(prof.to_json(), indent=1))
    return prof


def _host_memory_bytes() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return float(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _median_seconds(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _copy_bandwidth(torch) -> float:
    src = torch.ones(16 * 2**20)         # 64 MiB
    dst = torch.empty_like(src)
    seconds = _median_seconds(lambda: dst.copy_(src), 9)
    return 2 * src.numel() * src.element_size() / seconds


def _matmul_flops(torch) -> float:
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    return 2 * 512**3 / _median_seconds(lambda: a @ b, 9)


def _op_overhead(torch) -> float:
    x = torch.ones(4)

    def loop():
        for _ in range(2000):
            torch.add(x, x)
    return _median_seconds(loop, 5) / 2000


# World size of the threaded collective probes (the planner's sweep runs 4 ranks).
CALIBRATION_RANKS = 4


# The probe program's long context (tokens): long enough that its KV read shows over dispatch.
PROBE_CONTEXT = 4096


def _program_probe(torch) -> tuple[float, float]:
    """(seconds per graph op, effective KV bytes/s) of eager decode steps of the demo model
    on 1 rank, batch 4: at context 16 the step does next to no work (the dispatch cost of a
    program's ops, custom ones included); from context 16 to PROBE_CONTEXT the extra time
    is the attention kernel reading the extra KV."""
    from dcp_compile.driver import transform
    from dcp_compile.models.demo import demo_model
    from dcp_compile.runtime.distributed.world import bind_roles, run_threaded
    from dcp_compile.runtime.names import StepKind
    from dcp_compile.runtime.serving.engine import StepShapes
    from dcp_compile.runtime.serving.rank_engine import load_rank
    batch = 4
    model = demo_model()
    shapes = StepShapes.fitting(batch, 16, PROBE_CONTEXT + 1, block_size=16, dcp=1)
    program = transform(model, tp=1, dcp=1, check=False, shapes=shapes)
    ops = sum(1 for n in program.graphs[StepKind.DECODE].graph.nodes if n.op == "call_function")

    def rank_main(rank):
        loaded = load_rank(program, rank, bind_roles(program.topology, rank))
        caches = program.cache_spec().allocate()
        table = torch.arange(batch * shapes.max_blocks).view(batch, shapes.max_blocks)
        ids = torch.ones(batch, 1, dtype=torch.int64)
        with torch.no_grad():
            return [_median_seconds(lambda: loaded.run(StepKind.DECODE, ids,
                                                       torch.full((batch, 1), n), table,
                                                       caches), 15)
                    for n in (16, PROBE_CONTEXT)]

    short, long = run_threaded(1, rank_main, timeout=300)[0]
    extra = batch * (PROBE_CONTEXT - 16) * program.cache_spec().bytes_per_token()
    return short / ops, extra / max(long - short, 1e-9)


def _threaded_collectives(ranks: int) -> tuple[float, float]:
    import torch
    import torch.distributed as dist

    from dcp_compile.runtime.distributed.world import run_threaded

    def rank_main(rank):
        small, large = torch.ones(1), torch.ones(2**20)
        lat = _median_seconds(lambda: dist.all_reduce(small), 50)
        big = _median_seconds(lambda: dist.all_reduce(large), 9)
        return lat, big

    lat, big = run_threaded(ranks, rank_main, timeout=120)[0]
    # A ring all_reduce of n ranks sends 2 (n - 1) / n of the buffer per rank.
    wire = 4 * 2**20 * 2 * (ranks - 1) / ranks
    return lat, wire / max(big - lat, 1e-9)


def _gloo_collectives() -> tuple[float, float]:
    import subprocess
    import sys
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        script = Path(d) / "gloo_probe.py"     # spawn re-imports __main__: a file, not -c
        script.write_text(_GLOO_PROBE)
        out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                             timeout=120, check=True)
    lat, bw = json.loads(out.stdout.strip().splitlines()[-1])
    return lat, bw


_GLOO_PROBE = r"""
import json, os, statistics, sys, tempfile, time
import torch, torch.distributed as dist, torch.multiprocessing as mp

def med(fn, n):
    fn(); ts = []
    for _ in range(n):
        t = time.perf_counter(); fn(); ts.append(time.perf_counter() - t)
    return statistics.median(ts)

def main(rank, path, q):
    dist.init_process_group("gloo", init_method="file://" + path, rank=rank, world_size=2)
    small, large = torch.ones(1), torch.ones(2**20)
    lat = med(lambda: dist.all_reduce(small), 50)
    big = med(lambda: dist.all_reduce(large), 9)
    if rank == 0:
        q.put([lat, 4 * 2**20 / max(big - lat, 1e-9)])
    dist.destroy_process_group()

if __name__ == "__main__":
    path = tempfile.mktemp()
    ctx = mp.get_context("spawn"); q = ctx.Queue()
    mp.start_processes(main, args=(path, q), nprocs=2, start_method="spawn")
    print(json.dumps(q.get()))
"""


def with_overrides(prof: HardwareProfile, **values) -> HardwareProfile:
    """``prof`` with some fields replaced (a what-if: another link, more memory)."""
    return replace(prof, **values)
