#!/usr/bin/env bash
# Start the local services the tests use, where this machine allows it (root, apt).
# Each service script prints why it could not start; the tests then skip with that reason
# (or fail, when HPCTRAIN_REQUIRE_<SERVICE>=1).
set -u
cd "$(dirname "$0")/.."
action=${1:-start}
if [ -x slurm/local-cluster.sh ]; then
  slurm/local-cluster.sh "$action" || echo "services: local SLURM did not $action (tests that need it will say so)"
fi
exit 0
