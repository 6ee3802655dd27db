"""kvcopy's Cython layer: the only code that calls the CUDA driver."""
