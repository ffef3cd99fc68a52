"""One-shot look at the GPU machine: versions, packages, NVML, copy bandwidth, GEMM rate."""
import importlib, json, os, subprocess, sys, time
import torch

out = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda}
for mod in ["triton", "transformers", "pydantic", "typer", "rich", "pyarrow", "pandas", "matplotlib", "pynvml", "yaml",
            "bitsandbytes", "torchao", "optimi", "galore_torch", "apollo_torch", "lomo_optim", "flashoptim"]:
    try:
        m = importlib.import_module(mod)
        out[mod] = getattr(m, "__version__", "present")
    except Exception as exc:  # noqa: BLE001
        out[mod] = f"missing: {type(exc).__name__}"
print(json.dumps(out, indent=1))
dev = torch.device("cuda")
p = torch.cuda.get_device_properties(0)
print("device", p.name, p.multi_processor_count, "SMs", p.total_memory / 2**30, "GiB")
import pynvml
pynvml.nvmlInit(); h = pynvml.nvmlDeviceGetHandleByIndex(0)
print("nvml sm clock", pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM), "max", pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_SM),
      "mem", pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_MEM), "temp", pynvml.nvmlDeviceGetTemperature(h, 0),
      "power W", pynvml.nvmlDeviceGetPowerUsage(h) / 1000, "reasons", hex(pynvml.nvmlDeviceGetCurrentClocksEventReasons(h)),
      "driver", pynvml.nvmlSystemGetDriverVersion())
from triton.testing import do_bench
a = torch.empty(2 * 2**30, dtype=torch.uint8, device=dev).random_(); b = torch.empty_like(a)
ms = do_bench(lambda: b.copy_(a), warmup=50, rep=300, return_mode="median")
print(f"copy: {2 * a.numel() / ms / 1e6:.0f} GB/s (read+write)")
for (m, n, k) in [(8192, 8192, 8192), (4096, 4096, 512), (14336, 4096, 512), (128256, 4096, 512), (4096, 4096, 4096)]:
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16); y = torch.randn(k, n, device=dev, dtype=torch.bfloat16)
    ms = do_bench(lambda: x @ y, warmup=50, rep=200, return_mode="median")
    print(f"gemm {m}x{n}x{k}: {ms:.3f} ms {2*m*n*k/ms/1e9:.0f} TFLOP/s")
    # TN layout as in the wgrad dY^T X
    dy = torch.randn(k, m, device=dev, dtype=torch.bfloat16); xx = torch.randn(k, n, device=dev, dtype=torch.bfloat16)
    ms = do_bench(lambda: dy.t() @ xx, warmup=50, rep=200, return_mode="median")
    print(f"  wgrad-layout dY^T X: {ms:.3f} ms {2*m*n*k/ms/1e9:.0f} TFLOP/s")
