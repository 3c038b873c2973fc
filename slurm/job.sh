# shellcheck shell=bash disable=SC2154  # the MFR_* settings come from the rendered header
# Body of every megatron-fr Slurm batch job. megatron_fr/launch/slurm.py writes the #SBATCH
# lines and the MFR_* settings above a copy of this file (RUN_DIR/slurm/job.sbatch) and
# submits that; MFR_DRY_RUN=1 prints each step's command instead of running it (--dry-run).
#
#   node 1..R (rollout)   srun: megatron-fr serve x servers-per-node (background), each
#                         loading the recipe's model.hf_dir (MFR_HF_DIR) -> /health
#   node R+1..R+L         srun: torchrun (one per node) -> learner ranks: megatron-fr train,
#   (learner)                   told the servers' URLs, the weight group's address, the model
#
# Preemption / time limit: --signal=B:USR1@N makes the batch shell touch RUN_DIR/STOP; the run
# checkpoints the step it is in, logs "stopped on request at step N" and exits 0; this script
# then stops the servers and runs `scontrol requeue`. The rerun (SLURM_RESTART_COUNT=1) runs
# the same commands, and `megatron-fr train` resumes from its newest checkpoint by itself.
#
# Ports are fixed per job: torchrun MFR_PORT_BASE, weight group MFR_PORT_BASE+10 (+stage),
# server j (counted over all rollout nodes) MFR_PORT_BASE+100+j. They differ per node because
# the virtual nodes of a one-machine test cluster share one address; addresses come from each
# node's NodeAddr (scontrol show node), never from its hostname.
set -euo pipefail

: "${MFR_RUN_DIR:?}" "${MFR_RECIPE:?}" "${MFR_PYTHON:?}" "${MFR_REPO:?}" "${MFR_HF_DIR:?}"
: "${MFR_ROLLOUT_NODES:?}" "${MFR_LEARNER_NODES:?}" "${MFR_PROCS_PER_NODE:?}"
: "${MFR_ENGINE:?}" "${MFR_SERVERS_PER_NODE:?}" "${MFR_SERVER_GPUS:?}" "${MFR_SERVER_THREADS:?}"
: "${MFR_ROUTED_EXPERTS:?}"
: "${MFR_PORT_BASE:?}" "${MFR_HEALTH_TIMEOUT_S:?}"
DRY_RUN=${MFR_DRY_RUN:-0}
JOB_ID=${SLURM_JOB_ID:-dryrun}
RESTART=${SLURM_RESTART_COUNT:-0}
LOG_DIR=$MFR_RUN_DIR/logs/slurm-$JOB_ID.$RESTART
STOP_FILE=$MFR_RUN_DIR/STOP
MASTER_PORT=$MFR_PORT_BASE
WEIGHTS_PORT=$((MFR_PORT_BASE + 10))
SERVER_PORT_BASE=$((MFR_PORT_BASE + 100))
PREEMPTED=0

log() { printf '[%s job %s.%s] %s\n' "$(date +%H:%M:%S)" "$JOB_ID" "$RESTART" "$*"; }
die() { log "error: $*" >&2; exit 1; }
dry() { [ "$DRY_RUN" = 1 ]; }

# In a dry run, print a command (one line, words quoted where the shell needs it) instead.
run() {
    local word words=()
    if ! dry; then
        "$@"
        return
    fi
    for word in "$@"; do
        if [[ $word =~ ^[][A-Za-z0-9_./=:,@%+-]+$ ]]; then
            words+=("$word")
        else
            words+=("${word@Q}")
        fi
    done
    echo "${words[*]}"
}

# The CPUs each step's one task per node gets: the job's per-node request, or on whole nodes
# the fewest any node of the job has (SLURM_JOB_CPUS_PER_NODE, e.g. "64(x2),48"). Slurm >= 22.05
# gives a step's task one CPU unless told (srun no longer inherits --cpus-per-task).
step_cpus() {
    if [ -n "${MFR_CPUS_PER_NODE:-}" ]; then
        echo "$MFR_CPUS_PER_NODE"
    elif [ -n "${SLURM_JOB_CPUS_PER_NODE:-}" ]; then
        tr ',' '\n' <<<"$SLURM_JOB_CPUS_PER_NODE" | sed 's/(.*//' | sort -n | head -n 1
    fi
}

# srun one task per node on the nodes named (comma-separated), in the container if any.
srun_on() {
    local nodes=$1 count cpus cpu_flag=()
    shift
    count=$(tr ',' '\n' <<<"$nodes" | wc -l)
    cpus=$(step_cpus)
    [ -n "$cpus" ] && cpu_flag=(--cpus-per-task="$cpus")
    run srun --nodes="$count" --ntasks="$count" --ntasks-per-node=1 --nodelist="$nodes" \
        "${cpu_flag[@]}" --kill-on-bad-exit=1 "${MFR_CONTAINER[@]}" "$@"
}

resolve_nodes() {
    local want=$((MFR_ROLLOUT_NODES + MFR_LEARNER_NODES)) i
    if dry; then
        NODES=()
        for ((i = 1; i <= want; i++)); do NODES+=("node$i"); done
    else
        mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
    fi
    [ "${#NODES[@]}" -eq "$want" ] || die "allocation has ${#NODES[@]} nodes, the plan $want"
    ROLLOUT=("${NODES[@]:0:MFR_ROLLOUT_NODES}")
    LEARNERS=("${NODES[@]:MFR_ROLLOUT_NODES}")
}

node_addr() {
    if dry; then
        echo "$1"
        return
    fi
    scontrol show node "$1" -o | tr ' ' '\n' | sed -n 's/^NodeAddr=//p'
}

# Run a command in the background (LAST_PID: its PID); a dry run prints it in order instead.
spawn() {
    if dry; then
        "$@"
        LAST_PID=0
    else
        "$@" &
        LAST_PID=$!
    fi
}

# The text for `bash -c` that defines the functions named and calls the first with "$@".
program() {
    if dry; then
        echo "<$1 from slurm/job.sh>"
    else
        echo "$(declare -f "$@"); $1 \"\$@\""
    fi
}

join_by() {
    local IFS=$1
    shift
    echo "$*"
}

# --- the programs each step runs (sent to the nodes as text: `declare -f`) -------------------

# One rollout node: its servers (GPU group i for server i), until SIGTERM stops them all.
# Server i gets entries i*g..i*g+g-1 of the GPUs Slurm gave the step (its CUDA_VISIBLE_DEVICES,
# which on a shared node are not 0..N-1), or of 0..N-1 where Slurm sets none. routed=1 (the
# recipe's learner.routing_replay) makes every server return routed experts.
serve_node() {
    local log_dir=$1 python=$2 model=$3 engine=$4 count=$5 gpus=$6 threads=$7 routed=$8 port=$9
    shift 9
    local pids=() i extra=() flags=() visible=()
    [ "$routed" = 1 ] && flags=(--enable-return-routed-experts)
    [ $# -gt 0 ] && extra=(-- "$@")
    if [ "$gpus" -gt 0 ]; then
        IFS=, read -r -a visible <<<"${CUDA_VISIBLE_DEVICES:-$(seq -s, 0 $((count * gpus - 1)))}"
        if [ "${#visible[@]}" -lt $((count * gpus)) ]; then
            echo "error: $count server(s) x $gpus GPU(s), but the step sees ${#visible[@]}:" \
                "${CUDA_VISIBLE_DEVICES:-}" >&2
            return 1
        fi
    fi
    trap 'kill -TERM "${pids[@]}" 2>/dev/null; wait' TERM INT
    for ((i = 0; i < count; i++)); do
        (
            if [ "$gpus" -gt 0 ]; then
                CUDA_VISIBLE_DEVICES=$(IFS=,; echo "${visible[*]:i*gpus:gpus}")
                export CUDA_VISIBLE_DEVICES
            fi
            echo "server $i on $SLURMD_NODENAME port $((port + i))" \
                "gpus ${CUDA_VISIBLE_DEVICES:-none}"
            exec "$python" -m megatron_fr serve --model-path "$model" --port $((port + i)) \
                --host 0.0.0.0 --engine "$engine" --tp "$((gpus > 0 ? gpus : 1))" \
                --threads "$threads" "${flags[@]}" "${extra[@]}"
        ) >>"$log_dir/server-$SLURMD_NODENAME-$i.log" 2>&1 &
        pids+=($!)
    done
    wait
}

# One learner node: torchrun starting this node's ranks (node rank = srun task id).
learner_node() {
    local log_dir=$1 python=$2 nnodes=$3 nproc=$4 addr=$5 port=$6
    shift 6
    exec >>"$log_dir/learner-$SLURMD_NODENAME.log" 2>&1
    echo "learner node $SLURMD_NODENAME node_rank $SLURM_PROCID restart ${SLURM_RESTART_COUNT:-0}"
    exec "$python" -m torch.distributed.run --nnodes="$nnodes" --node-rank="$SLURM_PROCID" \
        --nproc-per-node="$nproc" --master-addr="$addr" --master-port="$port" --no-python \
        bash -c "$(declare -f learner_rank); learner_rank \"\$@\"" learner_rank \
        "$log_dir" "$python" "$@"
}

# One learner rank (under torchrun: RANK, WORLD_SIZE set): a log of its own, then train.
learner_rank() {
    local log_dir=$1 python=$2
    shift 2
    exec >>"$log_dir/rank-$RANK-$SLURMD_NODENAME.log" 2>&1
    echo "rank $RANK of $WORLD_SIZE (local $LOCAL_RANK) on $SLURMD_NODENAME" \
        "restart ${SLURM_RESTART_COUNT:-0}"
    exec "$python" -m megatron_fr.orchestrator.rank_main "$@"
}

# --- the job ---------------------------------------------------------------------------------

start_servers() {
    local index addr port i
    SERVER_PIDS=()
    URLS=()
    for index in "${!ROLLOUT[@]}"; do
        addr=$(node_addr "${ROLLOUT[index]}")
        port=$((SERVER_PORT_BASE + index * MFR_SERVERS_PER_NODE))
        for ((i = 0; i < MFR_SERVERS_PER_NODE; i++)); do
            URLS+=("http://$addr:$((port + i))")
        done
        spawn srun_on "${ROLLOUT[index]}" bash -c "$(program serve_node)" serve_node \
            "$LOG_DIR" "$MFR_PYTHON" "$MFR_HF_DIR" "$MFR_ENGINE" "$MFR_SERVERS_PER_NODE" \
            "$MFR_SERVER_GPUS" "$MFR_SERVER_THREADS" "$MFR_ROUTED_EXPERTS" "$port" \
            "${MFR_SERVER_ARGS[@]}"
        SERVER_PIDS+=("$LAST_PID")
    done
    log "servers: ${URLS[*]}"
}

# GET /health over bash's /dev/tcp: the batch shell runs outside any container, so it uses
# nothing that would have to be installed on the node.
healthy() {
    local line
    # shellcheck disable=SC2016  # $0 and $1 expand in the inner shell
    line=$(timeout 5 bash -c 'exec 3<>"/dev/tcp/$0/$1" || exit 1
        printf "GET /health HTTP/1.0\r\n\r\n" >&3; head -n 1 <&3' "$1" "$2" 2>/dev/null) \
        || return 1
    [[ $line == HTTP/*" 200"* ]]
}

wait_for_servers() {
    local deadline=$((SECONDS + MFR_HEALTH_TIMEOUT_S)) url hostport pending pid
    dry && return 0
    while :; do
        pending=0
        for url in "${URLS[@]}"; do
            hostport=${url#http://}
            healthy "${hostport%:*}" "${hostport##*:}" || pending=$((pending + 1))
        done
        [ "$pending" -eq 0 ] && break
        for pid in "${SERVER_PIDS[@]}"; do
            kill -0 "$pid" 2>/dev/null || die "a server step exited; see $LOG_DIR/server-*.log"
        done
        [ $SECONDS -lt "$deadline" ] \
            || die "$pending server(s) not healthy after ${MFR_HEALTH_TIMEOUT_S}s"
        sleep 2
    done
    log "servers healthy"
}

stop_servers() {
    local pid
    dry && return 0
    for pid in "${SERVER_PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
    for pid in "${SERVER_PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
    log "servers stopped (srun reports their steps as cancelled: that is this)"
}

stopped_on_request() {
    grep -qs "stopped on request at step" "$LOG_DIR"/rank-0-*.log
}

on_usr1() {
    PREEMPTED=1
    log "USR1 (preemption or time limit): the learner stops after its current step"
    touch "$STOP_FILE"
}

run_learners() {
    local addr nodes urls
    addr=$(node_addr "${LEARNERS[0]}")
    nodes=$(join_by , "${LEARNERS[@]}")
    urls="[$(printf '"%s",' "${URLS[@]}" | sed 's/,$//')]"
    log "learners on $nodes: $((MFR_LEARNER_NODES * MFR_PROCS_PER_NODE)) ranks, master $addr"
    spawn srun_on "$nodes" bash -c "$(program learner_node learner_rank)" learner_node \
        "$LOG_DIR" "$MFR_PYTHON" "$MFR_LEARNER_NODES" "$MFR_PROCS_PER_NODE" "$addr" \
        "$MASTER_PORT" "$MFR_RECIPE" --run-dir "$MFR_RUN_DIR" "${MFR_OVERRIDES[@]}" \
        "model.hf_dir=$MFR_HF_DIR" "rollout.engine.urls=$urls" "weights.master_address=$addr" \
        "weights.master_port=$WEIGHTS_PORT" "parallel.data_address=$addr"
    LEARNER_PID=$LAST_PID
}

# Wait for the learner step; after USR1, keep STOP in place until the run has taken it (a
# run that starts after the signal removes a STOP it finds: that one was for a previous run).
wait_for_learners() {
    local rc=0
    dry && return 0
    while kill -0 "$LEARNER_PID" 2>/dev/null; do
        if [ "$PREEMPTED" = 1 ] && [ ! -e "$STOP_FILE" ] && ! stopped_on_request; then
            touch "$STOP_FILE"
        fi
        sleep 1 &
        wait $! || true # returns early when USR1 arrives
    done
    wait "$LEARNER_PID" || rc=$?
    return "$rc"
}

main() {
    local rc=0 variable
    cd "$MFR_REPO"
    for variable in "${MFR_ENV[@]}"; do export "${variable?}"; done
    export PYTHONUNBUFFERED=1
    dry || mkdir -p "$LOG_DIR"
    trap on_usr1 USR1
    resolve_nodes
    log "nodes: rollout ${ROLLOUT[*]}; learner ${LEARNERS[*]}; logs $LOG_DIR"
    start_servers
    wait_for_servers
    run_learners
    wait_for_learners || rc=$?
    stop_servers
    if [ "$rc" -ne 0 ]; then
        die "the learner step failed (exit $rc); see $LOG_DIR/rank-*.log"
    fi
    if dry; then
        log "then: after USR1 and 'stopped on request' in rank 0's log:"
        run scontrol requeue "$JOB_ID"
    elif [ "$PREEMPTED" = 1 ] && stopped_on_request; then
        log "stopped on request: requeueing job $JOB_ID, the rerun resumes from the checkpoint"
        scontrol requeue "$JOB_ID"
    else
        rm -f "$STOP_FILE"
        log "run finished"
    fi
}

main
