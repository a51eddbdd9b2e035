#!/usr/bin/env bash
# SLURM and munge for the tests of `orchestrator launch slurm` (tests/test_launch_slurm.py): Debian's slurmctld,
# slurmd, slurm-client and munge (slurm-wlm 22.05 on Debian 12), without their recommends. The tests start their
# own cluster (orchestrator.testing.slurm: its own slurm.conf, munge key and state under a temporary directory);
# nothing here starts a daemon or writes a config. Idempotent: a second run checks the commands and returns
# (~0.1 s); a first install takes ~15 s (apt-get update ~5 s, eight packages ~10 s). Needs root (CI is root).
set -euo pipefail
need=(slurmctld slurmd sbatch srun scontrol squeue scancel sinfo munged munge)
missing=0
for cmd in "${need[@]}"; do
    command -v "$cmd" >/dev/null 2>&1 || [ -x "/usr/sbin/$cmd" ] || missing=1
done
if [ "$missing" = 0 ]; then
    exit 0
fi
if [ "$(id -u)" != 0 ]; then
    echo "slurm-setup: SLURM is not installed and this is not root: run as root (apt-get install slurmctld slurmd" \
         "slurm-client munge)" >&2
    exit 1
fi
start=$SECONDS
echo "slurm-setup: installing slurmctld, slurmd, slurm-client and munge (Debian packages)" >&2
export DEBIAN_FRONTEND=noninteractive
# the packages must not start their daemons (the tests start their own, by pid): a policy-rc.d that says no,
# unless the machine has one already (Debian images do), removed afterwards
if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d
    chmod +x /usr/sbin/policy-rc.d
    trap 'rm -f /usr/sbin/policy-rc.d' EXIT
fi
apt-get update -qq >/dev/null
apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null
echo "slurm-setup: done in $((SECONDS - start)) s ($(slurmctld -V))" >&2
