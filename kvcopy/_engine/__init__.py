"""How a validated batch is issued: dispatch picks the path (through kvcopy.policy)
and each path has its module: the copy kernel and batched DMA in dispatch, a store
and a load at once in both_ways, GPU staging buffers in staged, small batches
launched again in replay; traffic_window records when each direction last copied.
Private: the public faces (kvcopy.pointers, kvcopy.blocks, kvcopy.rows and their
both-ways forms, kvcopy.queue) are its callers."""
