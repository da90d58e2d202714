"""Real launches: scripts/pretrain_gpt.sh and torchrun, stops, preemption, restarts, SLURM, teardown, the GPU check
script."""
