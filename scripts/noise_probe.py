"""Where does the step-time spread come from? One arm, one process, three timing modes.

For each step it records: GPU time between CUDA events around the step, the host time the
Python call took to return (launch time: if it is close to the GPU time the step is host-bound
and its jitter is the host's), and, in a second pass, host wall time with a synchronize per step.
A third pass repeats the first with Python's garbage collector off.
"""
import argparse, gc, json, statistics, sys, time

import torch

from forge_bench import methods as methods_mod, models as models_mod


def q(xs, p):
    xs = sorted(xs); k = (len(xs) - 1) * p / 100; f = int(k); c = min(f + 1, len(xs) - 1)
    return xs[f] + (xs[c] - xs[f]) * (k - f)


def summary(name, xs):
    return f"{name}: median {statistics.median(xs):.1f} p10 {q(xs, 10):.1f} p90 {q(xs, 90):.1f} IQR/med {(q(xs, 75) - q(xs, 25)) / statistics.median(xs):.3f}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.1-8b"); ap.add_argument("--method", default="adamw_fused")
    ap.add_argument("--steps", type=int, default=30); ap.add_argument("--out")
    a = ap.parse_args()
    model = models_mod.build_model(a.model, "bfloat16", "cuda", seed=0)
    arm = methods_mod.get_method(a.method).build(model, methods_mod.TrainConfig(lr=1e-4, device="cuda"))
    batches = [models_mod.make_batch(a.model, 1, 512, "cuda", seed=i) for i in range(4)]
    for i in range(20):
        arm.step(batches[i % 4])
    torch.cuda.synchronize()
    res = {}
    for mode in ("events", "events_gc_off", "sync_each_step"):
        if mode == "events_gc_off":
            gc.collect(); gc.disable()
        gpu, host = [], []
        for i in range(a.steps):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter(); s.record()
            arm.step(batches[i % 4])
            e.record(); t1 = time.perf_counter()
            if mode == "sync_each_step":
                torch.cuda.synchronize(); t1 = time.perf_counter()
            host.append((t1 - t0) * 1e3); gpu.append(s)  # placeholder, replaced below
            gpu[-1] = (s, e)
        torch.cuda.synchronize()
        gpu = [s.elapsed_time(e) for s, e in gpu]
        gc.enable()
        res[mode] = {"gpu_ms": gpu, "host_ms": host}
        print(f"[{a.method}] {mode}: " + summary("gpu", gpu) + " | " + summary("host-return" if mode != "sync_each_step" else "host-sync", host), flush=True)
    if a.out:
        json.dump(res, open(a.out, "w"))


if __name__ == "__main__":
    main()
