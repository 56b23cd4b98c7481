"""kimi-host's Triton kernels (the tile-heavy ops of the GPU backend) and the harness that runs
them on the CPU through Triton's interpreter (`TRITON_INTERPRET=1`, numpy only, no torch)."""
