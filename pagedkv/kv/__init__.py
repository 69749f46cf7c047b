"""The paged KV cache: pool operations, block keys, the block pool and the per-request manager."""
