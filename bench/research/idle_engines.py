"""Do the engines a measurement is not timing take the cores from the one it is timing?

A trial process holds the FP32 reference and every plan of a round (a confirmation: five finalists, FP32 and the
one-liners). For ONNX Runtime (the backend's session options: intra-op spinning stopped when a run returns) and
OpenVINO (the backend's compile properties: LATENCY, one stream, the deployment's threads), this builds the model's
FP32 engine ``--idle`` more times, runs each a while, then times one engine alone for a second at a time and reads:

- the core time the threads only the idle engines started took meanwhile (0: they hold no runnable thread),
- this process's run-queue wait per second (``autotune.measure.interference``),
- the timed engine's median run, against the same with no idle engine alive, rounds interleaved.

    python bench/research/idle_engines.py autotune/examples/data/cnn.onnx --shape 32x1x16x16 --idle 6 \
        --out bench/results/shared_machine/idle_engines.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from autotune.measure.interference import Sampler

_TASKS = Path("/proc/self/task")


def thread_cpu_ns() -> dict[str, int]:
    """Per thread of this process, the nanoseconds it ran."""
    out = {}
    for task in _TASKS.iterdir():
        try:
            out[task.name] = int((task / "schedstat").read_text().split()[0])
        except OSError:
            continue
    return out


def ort_engines(model: str, feeds: dict, count: int, threads: int) -> list[Callable[[], object]]:
    """``count`` ONNX Runtime sessions of the model, with the ONNX Runtime backend's session options."""
    import onnxruntime as ort

    from autotune.backends.onnxruntime import spinning_entries

    runners = []
    for _ in range(count):
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        for key, value in spinning_entries({}).items():
            options.add_session_config_entry(key, value)
        session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
        runners.append(lambda session=session: session.run(None, feeds))
    return runners


def openvino_engines(model: str, feeds: dict, count: int, threads: int) -> list[Callable[[], object]]:
    """``count`` OpenVINO compiled models of the model, with the OpenVINO backend's compile properties."""
    import openvino as ov

    from autotune.backends.openvino.properties import compile_config

    core = ov.Core()
    read = core.read_model(model)
    runners = []
    for _ in range(count):
        request = core.compile_model(read, "CPU", compile_config(threads, {}, "fp32")).create_infer_request()
        runners.append(lambda request=request: request.infer(feeds))
    return runners


def time_for(run: Callable[[], object], seconds: float) -> list[float]:
    """Milliseconds of each run of ``run`` over ``seconds``."""
    times, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end:
        start = time.perf_counter()
        run()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def measure(make: Callable[[int], list[Callable[[], object]]], idle: int, rounds: int) -> dict:
    """The timed engine alone, then beside ``idle`` engines that each ran just before: rounds interleaved."""
    before = set(thread_cpu_ns())
    (timed,) = make(1)
    time_for(timed, 0.5)
    own = set(thread_cpu_ns()) - before
    others = make(idle)
    sampler = Sampler()
    alone, beside, idle_share, waits = [], [], [], []
    for _ in range(rounds):
        alone.append(float(np.median(time_for(timed, 0.5))))
        for engine in others:  # each idle engine ran just before, as in a round of a confirmation
            time_for(engine, 0.05)
        idle_threads = set(thread_cpu_ns()) - before - own
        start_cpu, start = thread_cpu_ns(), sampler.snapshot()
        beside.append(float(np.median(time_for(timed, 0.5))))
        end_cpu, end = thread_cpu_ns(), sampler.snapshot()
        reading = sampler.reading(start, end)
        taken = sum(end_cpu.get(t, 0) - start_cpu.get(t, 0) for t in idle_threads) / 1e9
        idle_share.append(taken / (reading.wall_s if reading else 0.5))
        waits.append(reading.waited if reading else None)
    ratios = [a / b for a, b in zip(alone, beside, strict=True)]
    return {
        "alone_ms": float(np.median(alone)),
        "beside_idle_ms": float(np.median(beside)),
        "alone_over_beside": float(np.median(ratios)),
        "idle_threads_core_share": [round(x, 4) for x in idle_share],
        "waited_per_s": [round(x, 4) for x in waits if x is not None],
    }


def main() -> None:
    """Measures both runtimes and prints (and writes) what it read."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--shape", required=True, help="the float input's shape, e.g. 32x1x16x16")
    parser.add_argument("--idle", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    import onnx

    name = onnx.load(args.model, load_external_data=False).graph.input[0].name
    shape = [int(x) for x in args.shape.split("x")]
    feeds = {name: np.random.default_rng(0).random(shape, dtype=np.float32)}
    results = {"machine": os.uname().machine, "cpus": os.cpu_count(), "idle_engines": args.idle}
    for runtime, make in (("onnxruntime", ort_engines), ("openvino", openvino_engines)):
        try:
            results[runtime] = measure(
                lambda n, make=make: make(args.model, feeds, n, args.threads), args.idle, args.rounds
            )
        except ImportError as error:
            results[runtime] = {"error": str(error)}
        print(runtime, json.dumps(results[runtime]))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
