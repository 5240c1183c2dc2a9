#!/usr/bin/env bash
# Create the Secrets deploy/k8s mounts, from the directory `retool secrets init` wrote:
#   retool-tls      ca.crt, {redis,rollout,trainer}.{crt,key}
#   retool-tokens   weight-token, rollout-token, sandbox-token, sandbox-token.sha256, reward-token
#   retool-redis    redis-users.acl, redis-{trainer,rollout,health}-password
#   retool-grafana  admin-password
# usage: deploy/k8s/create-secrets.sh SECRETS_DIR [NAMESPACE]   (DRY_RUN=1: print the YAML instead)
# The values go from the files to kubectl's stdin, never on a command line.
set -euo pipefail
dir=${1:?usage: create-secrets.sh SECRETS_DIR [NAMESPACE]}
ns=${2:-retool}
out() { if [ "${DRY_RUN:-0}" = 1 ]; then cat; echo "---"; else kubectl apply -f -; fi; }
secret() {
  local name=$1; shift
  local args=()
  for f in "$@"; do args+=("--from-file=${f%%=*}=$dir/${f#*=}"); done
  kubectl create secret generic "$name" --namespace "$ns" --dry-run=client -o yaml "${args[@]}" | out
}
secret retool-tls ca.crt=ca.crt redis.crt=redis.crt redis.key=redis.key rollout.crt=rollout.crt \
  rollout.key=rollout.key trainer.crt=trainer.crt trainer.key=trainer.key
secret retool-tokens weight-token=weight-token rollout-token=rollout-token sandbox-token=sandbox-token \
  sandbox-token.sha256=sandbox-token.sha256 reward-token=reward-token
secret retool-redis redis-users.acl=redis-users.acl redis-trainer-password=redis-trainer-password \
  redis-rollout-password=redis-rollout-password redis-health-password=redis-health-password
secret retool-grafana admin-password=grafana-admin-password
