"""CUDA graphs for the GPU tests: :func:`capture` (warm up, then capture one call), and for the benchmarks
(``tests/gpu/test_bench_*.py``) calls timed back to back in one graph, so launch overhead does not hide kernel time,
and the device's copy bandwidth measured in the same run."""
from __future__ import annotations

import statistics

import torch


def capture(fn):
    """Run ``fn()`` once on a side stream (Triton JIT, allocator), then capture it in a CUDA graph.
    Returns (graph, the static output of the captured call)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def graph_us(fns, calls: int = 48, replays: int = 15) -> tuple[float, torch.cuda.CUDAGraph]:
    """Median microseconds per call of ``fns[i % len(fns)]()`` for i < max(calls, len(fns)), captured in one CUDA
    graph after a warm-up of the first two on a side stream (Triton JIT, allocator) and replayed ``replays`` times.
    Returns (µs per call, the graph: replay it for pytest-benchmark's own rounds)."""
    seq = [fns[i % len(fns)] for i in range(max(calls, len(fns)))]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up outside the capture
        for f in fns[:2]:
            f()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in seq:
            f()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times) * 1e3 / len(seq), graph


def copy_bandwidth(device="cuda", nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth of ``nbytes`` uint8, bytes read + written per second (the benchmarks' 100 %)."""
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    us, graph = graph_us([lambda: dst.copy_(src)], calls=8)
    del src, dst, graph
    torch.cuda.empty_cache()
    return 2 * nbytes / (us * 1e-6)
