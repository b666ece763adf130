"""Speed and memory settings of training: how a step is computed, never what it computes (the same arithmetic,
up to the order of float sums or fused kernels).

* `microbatch`: how a process splits its share of a step into micro-batches (memory, not method);
* `compiled_layers`: the decoder layers compiled for the passes without a KV cache (time, not method).
"""
