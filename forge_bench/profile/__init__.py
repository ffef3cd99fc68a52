"""The GPU profilers behind ``forge-bench profile`` and the kernel benchmark behind ``forge-bench kernel``.

* ``step``: torch.profiler's top CUDA kernels per eager training step, per arm;
* ``timeline``: whether an eager step is host-bound, GPU-bound or stalled on a sync (CPU + CUDA trace);
* ``graph``: where the time of a CUDA-graph step goes, on both streams (what a sweep's graph cells time);
* ``kernel``: the fused wgrad + AdamW kernel per Llama-3.1-8B Linear shape against cuBLAS + fused
  AdamW and against its roofline.

Each profiler runs every arm in its own process (``common.run_each_method``), as a sweep cell does:
autotuners and the caching allocator keep state for the process life. Once warm, every arm's process
measures on the same two CPUs (``common.pin_measured_threads``, D114).
"""
