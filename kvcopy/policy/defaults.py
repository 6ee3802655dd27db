"""Every default a path uses, with why it has its value (docs/design.md has the
measurement behind each that one set). Pure constants; kvcopy.policy re-exports them,
and kvcopy.config's settings override some of them per process."""

from __future__ import annotations

# Copy-kernel CTAs per host direction when none were calibrated: the fewest that keep
# 0.90 of the contiguous copy from 2 KiB to 1 MiB blocks, leaving the SMs to the model.
HOST_CTAS = {"h2d": 4, "d2h": 2}
# The same for the layout kernel (copy_rows), which computes each row's address from
# its index and reads the index first: host-to-GPU rows need more CTAs in flight to
# hide the reads of host memory (8 keep 0.93 of the contiguous copy from 512 B rows,
# 16 from 128 B rows); GPU-to-host rows keep 0.93 from 2 CTAs.
ROWS_HOST_CTAS = {"h2d": 16, "d2h": 2}
# swap_blocks by the layout kernel writes its ids for the GPU in chunks, each launched
# as soon as it is written, so that the GPU starts after the first instead of after
# all: the first of this many pairs, each next at most ID_CHUNK_GROWTH times the one
# before (writing a pair's ids takes the CPU a small part of the time the GPU takes
# to copy the pair's block, so the GPU never waits for the next chunk).
ID_FIRST_CHUNK = 1024
ID_CHUNK_GROWTH = 8
# The layout kernel reads a call's host indices (swap_blocks' ids, copy_rows' host
# indices) where the CPU wrote them, in mapped pinned memory, instead of from a copy
# uploaded before it, while its reads of them (each index by a row's pieces in every
# plane) come to at most this many bytes of host memory: an upload is a driver call
# and a copy-engine operation the launch waits for (microseconds of CPU and of
# latency), a read in place one load per index and reader over the link, whose
# latency the kernel's copies hide.
INDICES_IN_PLACE_MAX_BYTES = 64 << 10
# CTAs per direction when a store and a load share one launch (copy_both_ways). With
# equal CTAs the GPU-to-host writes take most of the upstream link, and SM writes to
# host memory slow compute beside them far more than their share of SMs.
BOTH_WAYS_CTAS = {"h2d": 8, "d2h": 1}
# Mean block size from which a store and a load at once go by copy engines, issued in
# interleaved chunks (copy_both_ways): the kernel pair stays near 0.8 of the contiguous
# pair at every size, the engines reach it from here; below, their CPU cost per copy
# decides, which differs between hosts: calibrate() measures the host at hand.
BOTH_WAYS_BATCH_MIN_BYTES = 128 << 10
# CTAs of the copy kernel for copies between two GPUs when config.peer_ctas is None:
# enough to keep NVLink near its rate, far fewer than the whole GPU.
PEER_CTAS = 64
# CTAs per SM of the copy kernel for copies inside one GPU when config.device_ctas is
# None: with four, every SM keeps enough copies in flight for HBM's rate.
DEVICE_CTAS_PER_SM = 4
# Copies per cuMemcpyBatchAsync call when both ways go to the copy engines: smaller
# chunks start both directions sooner, larger ones cost less CPU per copy.
BOTH_WAYS_DMA_CHUNK = 64
# A batch is one side of a copy both ways only where the other direction's last batch
# holds this share of its bytes: batched DMA pays off once a fifth (host->GPU) to a
# third (GPU->host) of a batch overlaps; a quarter keeps small copies from counting.
OTHER_WAY_MIN_SHARE = 0.25
# CTAs (of launch.BULK_THREADS threads, two warps) of the bulk copier for GPU-to-host
# copies: the fewest that keep the link's rate, at a small part of what register
# stores cost compute beside them.
BULK_STORE_CTAS = 4
# Mean block sizes for which those CTAs keep 0.90 of the contiguous copy alone; outside,
# the register copier does better, and more bulk CTAs would cost what registers do.
BULK_MIN_BYTES, BULK_MAX_BYTES = 16 << 10, 64 << 10
# Batches whose host side is a few long spans (LMCache's chunks, a host pool handed out
# in order) go through a GPU staging buffer (kvcopy._engine.staged): the copy engines move each
# span whole and the copy kernel scatters (or gathers) the GPU's blocks inside the GPU.
# A staged batch pays a chunk's copy before its first scatter and a second pass over
# its copies on the CPU, so small batches stay with the kernel; each span is one
# cuMemcpyAsync (a few microseconds of CPU), so spans must be long.
STAGING_MIN_BYTES = 64 << 20
STAGING_MIN_SPAN_BYTES = 1 << 20
# A store and a load at once in layout form with GPU indices, each host side rows back
# to back (copy_rows_both_ways), go through staging buffers from this many bytes a side
# (kvcopy._engine.rows_staged): there the layout kernel's pair keeps 0.75-0.79 of two
# contiguous copies by GPU time, the copy engines' pair with the kernel inside the GPU
# 0.90-0.92 (0.86-0.90 at 4 MiB a side, one chunk, where its CPU per chunk costs more
# of the wall); experiments/rows_both_ways_staged.py sizes. Staging one side alone, the
# other on the kernel, gained nothing (same script, sides), so only pairs are staged. A
# host side of more than ROWS_STAGING_MAX_PLANES planes would cost a copy-engine call
# per plane per chunk.
ROWS_STAGING_MIN_BYTES = 8 << 20
ROWS_STAGING_MAX_PLANES = 8
# CTAs of each staged chunk's scatter (or gather) inside the GPU: a 4 MiB chunk then
# takes a small part of the time its copy over PCIe takes, and the SMs stay with the model.
STAGING_CTAS = 16
# Descriptor-ring slots per context (kvcopy._runtime.ring): enough launches in flight
# that a call rarely waits for a slot, few enough that their pinned memory stays small.
RING_SLOTS = 8
# The least a slot is allocated with (sizes round up to a power of two from here), so
# that the small batches of a step all fit the slots they find.
RING_MIN_CAPACITY_BYTES = 128 << 10
# kvcopy's own side streams per context (kvcopy._runtime.side_streams), beyond which
# callers' streams share them.
MAX_SIDE_STREAMS = 16
# A pinned host pool (kvcopy.host_pool) is registered with the driver in chunks of
# about this size: page-locking holds driver-wide locks for the whole of one call,
# stalling every other CUDA call on the host, and one call of hundreds of GiB fails.
POOL_CHUNK_BYTES = 256 << 20
# No registration is larger than this: below the 2 GB that Linux 6.11-6.13 pin at
# most in one call.
POOL_MAX_CHUNK_BYTES = 1 << 30
# The pause between two registrations, so that processes waiting on the driver's locks
# take them before the next chunk does.
POOL_CHUNK_PAUSE_S = 0.001
# Threads that touch a pool's pages first (each bound to the pool's node): past a few
# dozen, more add little (8 GiB mapped, touched and registered: 4/8/16/32 threads
# 1.55/1.09/1.03/0.92 s).
POOL_TOUCH_THREADS = 32
# A pool's pages are touched in waves, each chunk registered once its wave is touched:
# the first wave is the first chunk alone (the pool's first bytes usable at once), the
# others whole chunks of at least this many bytes, touched while the wave before is
# registered; 0: the rest of the pool in one wave, registered once touched whole.
# Registering beside the touch slows both: 64 GiB of transparent huge pages on an H100
# host (16 CPUs) in waves of 1 GiB took 10.4 s (touch 10.3 s, the registrations 5.6 s
# beside it); touched whole, then registered, 8.2 s on a host of the same kind, where
# one registration of all of it takes 0.8 s (bench/host_pool.py compares both).
POOL_TOUCH_WAVE_BYTES = 0
# Explicit huge pages back a pool only where rounding up to whole pages adds at most
# this share of the pool (a 1 GiB page for a 100 MiB pool would waste ten times it).
POOL_EXPLICIT_MAX_WASTE = 0.125
# Calibration at first use (kvcopy._runtime.first_use, config.auto_calibrate): it starts
# once the device has issued no copy between host and GPU for this long, so that it
# measures in a gap of the caller's traffic rather than beside it;
AUTO_CALIBRATION_QUIET_S = 1.0
# with kvcopy.calibrate()'s own volume and these repeats (about a second of the GPU,
# once), so that it measures a store and a load at once too
# (BOTH_WAYS_CALIBRATION_MIN_BYTES, below);
AUTO_CALIBRATION_BYTES = 64 << 20
AUTO_CALIBRATION_REPEATS = 3
# and a process that finds another one of the host measuring the same GPU waits this
# long for its file, asking every AUTO_CALIBRATION_POLL_S, before it gives up (the
# defaults serve on); one whose measuring peer died takes its place.
AUTO_CALIBRATION_WAIT_S = 600.0
AUTO_CALIBRATION_POLL_S = 0.5
# A store and a load at once are measured only where a calibration moves at least this
# much (kvcopy.calibrate()'s own volume); below it the default or an earlier
# calibration's crossover stays. Timed from the call to the end of both, a smaller
# volume weighs the copy engines' submission too heavily: at 16 MiB (8 MiB a side) the
# first-use calibration found them never ahead up to 256 KiB on an H100 host, and
# 'auto' kept the kernel pair at 0.60 of the contiguous pair at 128-256 KiB blocks
# where the engines gave 0.73-0.85 of its wall time (the default had them from 128 KiB
# on another such host; the quick benchmark's both-directions stage shows both).
BOTH_WAYS_CALIBRATION_MIN_BYTES = 64 << 20
# The guard (kvcopy.policy.guard): a sampled batch of at least GUARD_MIN_BYTES whose
# rate is below GUARD_SLOW_SHARE of what calibration measured for its method, direction
# and block size is slow; GUARD_SLOW_SAMPLES slow ones in a row move 'auto' to the other
# method where calibration measured that one above GUARD_GAIN times the slow rate, for
# GUARD_HOLD_S, doubled at each move of the same path, at most GUARD_MAX_HOLD_S. One
# batch a device is sampled at a time, at most every GUARD_SAMPLE_EVERY_S (two events
# recorded beside it). A host whose SMs read host memory at 33 GB/s on a link whose
# copy engines reach 54 (one H100 host) runs its kernel at 0.6 of another host's.
GUARD_MIN_BYTES = 4 << 20
GUARD_SLOW_SHARE = 0.7
GUARD_SLOW_SAMPLES = 3
GUARD_GAIN = 1.1
GUARD_HOLD_S = 10.0
GUARD_MAX_HOLD_S = 300.0
GUARD_SAMPLE_EVERY_S = 0.05
