"""Launching a whole job on a cluster through its own scheduler: SLURM (an sbatch script whose batch step runs
each role as a job step) or Kubernetes (manifests). ``[launch]`` (config.py) says where each role runs;
docs/launch.md says what runs where, ports, keys, and how to watch and stop a job."""
