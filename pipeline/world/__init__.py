"""The world a launched rank joins: who it is among the launcher's processes (distributed, slurm), the
rendezvous that waits for every rank, DeepSpeed's CPU all-reduce built before it (deepspeed_op), and how a
launched process ends."""
