"""What the CPU and GPU tests share: fakes of the driver's callers, GPU pools, child runs."""
