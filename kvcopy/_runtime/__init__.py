"""What kvcopy keeps per process and per CUDA context: device facts and calibrated
thresholds (and the files behind them), the copy kernel's build and cache, the
descriptor rings, side streams, peer access, and prepare(). Private: the public
faces (kvcopy.pointers, kvcopy.blocks, kvcopy.rows, kvcopy.queue, kvcopy.calibrate)
are the only callers outside kvcopy._engine."""
