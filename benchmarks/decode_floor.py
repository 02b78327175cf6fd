"""Decode against the memory-bandwidth floor: how far an engine's TPOT is from the time it takes
only to read what one decode step must read, and where the rest goes.

For an engine folder: the bytes one decode step reads (the decode graph's initializers, external
data included, less the embedding table and the rotary tables, of which a step reads a row; plus
the KV cache at each ``--contexts`` length, in the engine's cache dtype); this machine's read
bandwidth, measured with ONNX Runtime itself (``ReduceSum`` over a 1 GiB float32 tensor,
``--bandwidth-mib``; 1 and 2 threads, median of 6 after a warm-up); the floor, bytes / the best
bandwidth; the measured TPOT (median over ``--new-tokens`` steps, ``--repeats`` runs); and, at
each context, ONNX Runtime's profile of the decode steps by op type (``enable_profiling``; the
profiler slows each node a little, so its milliseconds are shares, not the TPOT). A TPOT near the floor cannot
drop much on this machine without fewer bytes; a gap shows which kernel to look at.

    python -m benchmarks.decode_floor --engine <engine folder> [--contexts 256 1024 4096]
        [--new-tokens 32] [--repeats 3] [--json out.json]

The command and the recorded results: ``benchmarks/README.md`` (decode_floor).
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import load_line, make_parser, measure_and_report, ort_model

GIB = 2**30


def read_bandwidth(threads: int, size: int = GIB, repeats: int = 6) -> float:
    """Bytes per second ONNX Runtime reads summing a ``size``-byte float32 tensor on ``threads``."""
    import numpy as np
    import onnxruntime as ort
    from onnx import TensorProto, helper

    count = size // 4
    graph = helper.make_graph(
        [helper.make_node("ReduceSum", ["x"], ["y"], keepdims=0)],
        "read",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [count])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    data = np.ones(count, np.float32)
    seconds = []
    for _ in range(repeats + 1):
        started = time.perf_counter()
        session.run(None, {"x": data})
        seconds.append(time.perf_counter() - started)
    return data.nbytes / statistics.median(seconds[1:])


def step_weight_bytes(model_file: Path) -> dict[str, int]:
    """Bytes of the graph's initializers a decode step reads, and of those it reads a row of."""
    import onnx

    graph = onnx.load(str(model_file), load_external_data=False).graph
    sizes = {}
    for tensor in graph.initializer:
        external = {entry.key: entry.value for entry in tensor.external_data}
        if "length" in external:
            sizes[tensor.name] = int(external["length"])
        else:
            sizes[tensor.name] = len(tensor.raw_data) or onnx.numpy_helper.to_array(tensor).nbytes
    row_read = {n.input[0] for n in graph.node if n.op_type == "Gather"}  # the embedding table
    row_read |= {i for n in graph.node if n.op_type == "GroupQueryAttention" for i in n.input[7:9]}
    row_read &= set(sizes)
    return {
        "read": sum(size for name, size in sizes.items() if name not in row_read),
        "row_read": sum(sizes[name] for name in row_read),
    }


def decode_profile(engine: Any, prompt: list[int], new_tokens: int) -> dict[str, float]:
    """Milliseconds per decode step by op type (ONNX Runtime's profiler, one generation)."""
    import onnxruntime as ort

    from pipeline.runtime import Engine, GenerationConfig
    from pipeline.runtime import ort as runtime

    original = runtime.session_options
    with tempfile.TemporaryDirectory(prefix="decode-profile-") as folder:

        def profiled(*args: Any, **kwargs: Any) -> ort.SessionOptions:
            options = original(*args, **kwargs)
            options.enable_profiling = True
            options.profile_file_prefix = str(Path(folder) / "decode")
            return options

        runtime.session_options = profiled
        try:
            profiled_engine = Engine(engine.folder, prefill_graph=False)
        finally:
            runtime.session_options = original
        profiled_engine.generate_ids([prompt], GenerationConfig(max_new_tokens=new_tokens, stop_at_eos=False))
        events = json.loads(Path(ort_model(profiled_engine).session.end_profiling()).read_text())
    runs = [e for e in events if e.get("name") == "model_run"]
    decode_start = runs[1]["ts"]  # run 0 is the prefill
    by_op: collections.Counter[str] = collections.Counter()
    for event in events:
        if (
            event.get("cat") == "Node"
            and event["name"].endswith("_kernel_time")
            and event["ts"] >= decode_start
        ):
            by_op[event["args"]["op_name"]] += event["dur"]
    steps = len(runs) - 1
    by_op["(all decode steps)"] = sum(run["dur"] for run in runs[1:])
    return {op: micros / 1000 / steps for op, micros in by_op.most_common()}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import numpy as np
    from tqdm.auto import tqdm

    from pipeline.core.engine import KV_NUMPY_DTYPES
    from pipeline.runtime import Engine, GenerationConfig

    engine = Engine(args.engine)
    io = engine.io
    weights = step_weight_bytes(engine.folder / engine.spec["model_file"])
    bandwidth = {threads: read_bandwidth(threads, args.bandwidth_mib * 2**20) for threads in (1, 2)}
    best = max(bandwidth.values())
    itemsize = np.dtype(KV_NUMPY_DTYPES[io.kv_dtype]).itemsize  # float8 codes: 1 byte
    kv_per_token = 2 * io.num_layers * io.num_kv_heads * io.head_dim * itemsize
    rng = np.random.default_rng(0)
    config = GenerationConfig(max_new_tokens=args.new_tokens, stop_at_eos=False)
    rows = []
    for context in tqdm(args.contexts, desc="contexts", unit="context", file=sys.stderr):
        prompt = rng.integers(4, io.vocab_size, size=context).tolist()
        tpots = []
        for _ in range(args.repeats):
            result = engine.generate_ids([prompt], config)
            tpots.append(statistics.median(result.step_seconds))
        read = weights["read"] + kv_per_token * (context + args.new_tokens // 2)
        floor = read / best
        tpot = statistics.median(tpots)
        rows.append(
            {
                "context": context,
                "bytes_per_step": read,
                "floor_ms": floor * 1e3,
                "tpot_ms": tpot * 1e3,
                "tpot_vs_floor": tpot / floor,
                "profile_ms_per_step": decode_profile(engine, prompt, args.new_tokens),
            }
        )
    return {
        "engine": str(args.engine),
        "kv_dtype": io.kv_dtype,
        "weights": weights,
        "read_bandwidth_gb_s": {str(t): b / 1e9 for t, b in bandwidth.items()},
        "repeats": args.repeats,
        "new_tokens": args.new_tokens,
        "rows": rows,
    }


def print_table(record: dict[str, Any]) -> None:
    bandwidth = ", ".join(f"{t} thread(s) {b:.1f} GB/s" for t, b in record["read_bandwidth_gb_s"].items())
    weights = record["weights"]
    print(f"read bandwidth (ONNX Runtime ReduceSum): {bandwidth}")
    read, row_read = weights["read"] / 2**20, weights["row_read"] / 2**20
    print(
        f"weights a decode step reads: {read:.1f} MiB (+ {row_read:.1f} MiB of embedding/rotary tables "
        f"it reads a row of); KV cache: {record['kv_dtype']}"
    )
    columns = f"{'context':>8} {'MiB/step':>9} {'floor ms':>9} {'TPOT ms':>8} {'TPOT/floor':>11}"
    print(f"{columns}  decode step by op (ms, profiled)")
    for row in record["rows"]:
        ops = [(op, ms) for op, ms in row["profile_ms_per_step"].items() if not op.startswith("(")]
        top = ", ".join(f"{op} {ms:.2f}" for op, ms in ops[:3])
        print(
            f"{row['context']:>8} {row['bytes_per_step'] / 2**20:>9.1f} {row['floor_ms']:>9.2f} "
            f"{row['tpot_ms']:>8.2f} {row['tpot_vs_floor']:>10.2f}x  {top}"
        )
    runs = f"median of {record['repeats']} runs of {record['new_tokens']} tokens"
    print(f"{load_line(record['load_before'], record['load_after'])}; TPOT: {runs}")


def main(argv: list[str] | None = None) -> int:
    parser = make_parser(__file__, __doc__)
    parser.add_argument("--engine", type=Path, required=True, help="an ort-cpu engine folder (engine.json)")
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--bandwidth-mib", type=int, default=1024, help="the tensor the bandwidth is read from"
    )
    parser.add_argument("--json", type=Path, help="also write the record here")
    args = parser.parse_args(argv)
    if not (args.engine / "engine.json").is_file():
        parser.error(f"--engine {args.engine}: no engine.json there (an engine folder of a pipeline run)")
    if args.repeats < 1 or min(args.contexts) < 1 or args.new_tokens < 2 or args.bandwidth_mib < 1:
        parser.error("--repeats, --contexts and --bandwidth-mib must be at least 1, --new-tokens at least 2")
    return measure_and_report(args, measure, print_table)


if __name__ == "__main__":
    sys.exit(main())
