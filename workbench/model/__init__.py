"""Models: loading, quantization and adapters, attention kernels, the chunked loss, fast paths and generation."""
