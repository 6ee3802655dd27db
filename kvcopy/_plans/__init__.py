"""What to copy, validated: copy plans (pointer triples planned by the C loop in
kvcopy._cuda.plan_arrays), block plans (tensors, block ids and the geometry between
them), and the races and overlaps found in them. Pure: no driver call."""
