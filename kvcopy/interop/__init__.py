"""The only code of kvcopy that knows torch, CuPy, JAX, NumPy and cuda.core objects:
streams, events, pointer arrays and tensors become raw handles, addresses and
extents here. Nothing in this package calls the CUDA driver."""
