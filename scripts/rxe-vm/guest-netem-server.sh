#!/bin/bash
# Runs INSIDE the server guest of run-netem: rdma_rxe on eth1 (10.77.0.1),
# then anydoor-netem-check --server until the client sends quit.
set -u
modprobe -a rdma_rxe ib_uverbs rdma_ucm || { echo "cannot load rdma_rxe"; exit 100; }
ip link set lo up
ip addr add 10.77.0.1/24 dev eth1 && ip link set eth1 up || { echo "no eth1"; exit 101; }
rdma link add rxe0 type rxe netdev eth1 || { echo "cannot create rxe0"; exit 102; }
ulimit -l unlimited
export ANYDOOR_LOG=warn ANYDOOR_PROVIDER=verbs
timeout 500 bin/anydoor-netem-check --server --listen 10.77.0.1:7300
