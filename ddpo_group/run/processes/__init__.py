"""Several processes and the machine: one failure stops all, FSDP on the CPU, determinism, threads, stop signals."""
