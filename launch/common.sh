# shellcheck shell=bash
# Shared body of launch/midtrain.sh and launch/sft.sh; they set the stage-specific variables and call
# `launch "$@"`. One script covers three places so the command that runs on the cluster is the one tested:
#   SLURM (SLURM_JOB_ID set)  one torchrun per node via srun, rendezvous at the first host of the job; a rank per
#                             GPU, or on a node without GPUs (a CPU partition) a gloo rank per task SLURM allocates;
#   local, GPUs or CPU        one torchrun --standalone (CPU: 2 gloo processes);
#   embedded demo             local + no CONFIG (GPUs or not): build the demo data, train on CPU, plot the loss and
#                             print the run's summary line (first-10 / last-10 step means, wall time).
# The first line says which config runs and why (CONFIG, or the default of the place: the paper's on SLURM, the demo
# elsewhere).
# Arguments are trainer flags (passed through); `--dry-run` anywhere prints the launch command, the
# environment and the trainer's resolved config, and starts nothing.
#
# Caller sets: STAGE, PAPER_CONFIG, DEMO_CONFIG, DEMO_PREP_ARGS (array; empty: the stage builds no
# demo data), DEMO_NEEDS (array of paths the demo needs, with DEMO_NEEDS_HINT saying how to make them), and
# optionally TRAIN_MODULE (the entry module; default the trainer) and DEMO_PLOT_ARGS (array for tools/plot_run.py);
# the RL stages take their demo settings from rl_demo_defaults (called after sourcing this file).
# Environment overrides: CONFIG, PYTHON, NPROC (processes per node; GPUS_PER_NODE, its SLURM name, works too), NNODES,
# NODE_RANK, MASTER_ADDR, MASTER_PORT, DATA_PATH, SAVE, PRETRAINED_HF, SHUTDOWN_TIMEOUT, MIMESIS_DEMO (0: not the demo
# even with its config, as the pipeline runs it), ROLLOUT_* (an RL stage's split layout under SLURM: rollout_side),
# and any NCCL_* / CUDA_* / OMP_NUM_THREADS.

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TRAIN_MODULE="${TRAIN_MODULE:-megatron_mimesis.training.train}"

die() {
  echo "error: $*" >&2
  exit 1
}

# Count of visible GPUs; 0 where there is no nvidia-smi or it finds none.
gpu_count() {
  local listing
  listing="$(nvidia-smi -L 2>/dev/null || true)"
  grep -c '^GPU' <<<"$listing" || true
}

# The value of `key:` in the YAML config, via the same yaml loader the trainer uses ('' when absent/null).
config_value() {
  "$PYTHON" -c 'import sys, yaml; print((yaml.safe_load(open(sys.argv[1])) or {}).get(sys.argv[2]) or "")' \
    "$CONFIG" "$1"
}

# The value of `--flag VALUE` / `--flag=VALUE` among the trainer arguments, if given.
flag_value() {
  local flag="$1" i
  for ((i = 0; i < ${#train_args[@]}; i++)); do
    case "${train_args[i]}" in
      "$flag") echo "${train_args[i + 1]:-}" ;;
      "$flag="*) echo "${train_args[i]#*=}" ;;
    esac
  done
}

# Cluster defaults; each keeps a value the user already exported.
set_gpu_env() {
  # One CUDA connection keeps the sequence-parallel all-gather/reduce-scatter ordered ahead of the GEMMs
  # they overlap with (Megatron-LM's requirement for TP comm overlap).
  export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-1}"
  # Fail fast on a hung or failed collective instead of waiting forever.
  export TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}"
  # Bootstrap traffic off loopback and docker bridges; set NCCL_IB_HCA (e.g. mlx5) for your fabric.
  export NCCL_SOCKET_IFNAME="${NCCL_SOCKET_IFNAME:-^lo,docker}"
  # gloo (megatron-core's CPU-side groups, vLLM's) finds its interface through the hostname, which on many nodes
  # resolves to 127.0.1.1 or a bridge: startup then hangs. It takes NCCL's interfaces when those are named, else
  # the default route's; export GLOO_SOCKET_IFNAME to choose.
  if [[ -z "${GLOO_SOCKET_IFNAME:-}" ]]; then
    local gloo_ifname
    gloo_ifname="$(gloo_interface)"
    if [[ -n "$gloo_ifname" ]]; then export GLOO_SOCKET_IFNAME="$gloo_ifname"; fi
  fi
  export NCCL_IB_TIMEOUT="${NCCL_IB_TIMEOUT:-22}"
  export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
  local cores
  cores="$(nproc)"
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$((cores / gpus_per_node > 0 ? cores / gpus_per_node : 1))}"
  env_names=(CUDA_DEVICE_MAX_CONNECTIONS TORCH_NCCL_ASYNC_ERROR_HANDLING NCCL_SOCKET_IFNAME GLOO_SOCKET_IFNAME
    NCCL_IB_TIMEOUT NCCL_DEBUG OMP_NUM_THREADS)
}

# The interfaces for gloo: NCCL_SOCKET_IFNAME when it lists interfaces of this node by their full names (gloo takes
# neither NCCL's ^exclusions, =exact form nor name prefixes such as "ib"), else the interface of this node's default
# route; empty when neither is known.
gloo_interface() {
  local names name
  IFS=, read -ra names <<<"$NCCL_SOCKET_IFNAME"
  for name in "${names[@]}"; do
    [[ -n "$name" && -e "/sys/class/net/$name" ]] || {
      ip -o route show default 2>/dev/null | awk '{for (i = 1; i < NF; i++) if ($i == "dev") {print $(i + 1); exit}}'
      return
    }
  done
  echo "$NCCL_SOCKET_IFNAME"
}

set_cpu_env() {
  # Each gloo rank is one process; more threads per rank only oversubscribe the cores.
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
  env_names=(OMP_NUM_THREADS)
}

# A CPU node of a SLURM job (a CPU partition, where a setup is tried before GPU hours are spent): gloo ranks as on a
# laptop, one per task SLURM allocates on the node, each with its share of the node's CPUs, and gloo on the interface
# of the default route (across nodes, as NCCL's would be).
set_slurm_cpu_env() {
  local cores="${SLURM_CPUS_ON_NODE:-$(nproc)}"
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$((cores / gpus_per_node > 0 ? cores / gpus_per_node : 1))}"
  if [[ -z "${GLOO_SOCKET_IFNAME:-}" ]]; then
    local gloo_ifname
    gloo_ifname="$(NCCL_SOCKET_IFNAME="" gloo_interface)"
    if [[ -n "$gloo_ifname" ]]; then export GLOO_SOCKET_IFNAME="$gloo_ifname"; fi
  fi
  env_names=(OMP_NUM_THREADS GLOO_SOCKET_IFNAME)
}

# Tasks per node of the allocation (SLURM_NTASKS_PER_NODE, else the first count of SLURM_TASKS_PER_NODE, "2(x4)"):
# the ranks of a CPU node.
slurm_tasks_per_node() {
  local tasks="${SLURM_NTASKS_PER_NODE:-${SLURM_TASKS_PER_NODE:-1}}"
  echo "${tasks%%[(,]*}"
}

# The address of a node of the job: its name where that resolves, else the address SLURM itself reaches it at
# (NodeAddr), so that the rendezvous works on clusters whose node names are not in DNS (the pipeline's server job
# records its address by the same rule).
node_address() {
  "$PYTHON" -m megatron_mimesis.pipeline.cluster address "$1"
}

# Trainer flags from the environment. Where a run starts is the trainer's one rule (TrainConfig.resolve_start): a
# `save` directory holding a checkpoint is resumed (a requeued job), whatever the config or PRETRAINED_HF say.
add_env_flags() {
  if [[ -n "${DATA_PATH:-}" ]]; then train_args+=(--data-path "$DATA_PATH"); fi
  if [[ -n "${SAVE:-}" ]]; then train_args+=(--save "$SAVE"); fi
  if [[ -n "${PRETRAINED_HF:-}" ]]; then train_args+=(--pretrained-hf "$PRETRAINED_HF"); fi
}

# The split layout of an RL stage under SLURM (ROLLOUT_NODES=1): the job's first node serves the policy with vLLM's
# OpenAI server and the others train, with engine=served pointed at it (rl/engines/served.py); run_srun starts the
# server, waits until it answers, then the trainer, and stops the server when the trainer ends. ROLLOUT_MODEL: the HF
# directory the server starts from (default the config's pretrained_hf; the trainer sends its own weights before the
# first rollout, so only the architecture must match); ROLLOUT_ARGS: vLLM flags (e.g. "--tensor-parallel-size 2
# --data-parallel-size 4" on 8 GPUs); ROLLOUT_PYTHON (default PYTHON), ROLLOUT_PORT (8000), ROLLOUT_START_TIMEOUT
# (1800 s); ROLLOUT_WEIGHTS_DIR: the directory both sides see for the weight updates (default <log_dir>/rollout-weights).
rollout_side() {
  ((ROLLOUT_NODES == 1)) || die "ROLLOUT_NODES=$ROLLOUT_NODES: the split layout takes one rollout node (one vLLM server)"
  ((${#hosts[@]} > 1)) || die "ROLLOUT_NODES=1 needs a job of 2 nodes or more: the first serves, the others train"
  local model="${ROLLOUT_MODEL:-$(config_value pretrained_hf)}" args=() weights
  [[ -n "$model" ]] || die "ROLLOUT_NODES=1: set ROLLOUT_MODEL, the HF directory the rollout server starts from"
  read -ra args <<<"${ROLLOUT_ARGS:-}"
  weights="$(realpath -m "${ROLLOUT_WEIGHTS_DIR:-$(dirname "$(exit_record)")/rollout-weights}")"
  rollout_url="http://$(node_address "${hosts[0]}"):${ROLLOUT_PORT:-8000}"
  rollout_cmd=(srun --nodes=1 --ntasks=1 --relative=0 --kill-on-bad-exit=1 env VLLM_SERVER_DEV_MODE=1
    "${ROLLOUT_PYTHON:-$PYTHON}" -m vllm.entrypoints.openai.api_server --model "$model" --served-model-name policy
    --host 0.0.0.0 --port "${ROLLOUT_PORT:-8000}" "${args[@]}")
  local engine=(--engine served --engine-options
    "{\"base_url\": \"$rollout_url/v1\", \"model\": \"policy\", \"weights_dir\": \"$weights\"}")
  train_args+=("${engine[@]}")
  trainer+=("${engine[@]}")
}

# The rollout server of a split layout, in the background until it answers /health, its output (vLLM's and srun's) in
# <log_dir>/rollout-server.log; run_srun stops it at the end.
start_rollout_server() {
  rollout_log="$(dirname "$(exit_record)")/rollout-server.log"
  mkdir -p "$(dirname "$rollout_log")"
  "${rollout_cmd[@]}" >>"$rollout_log" 2>&1 &
  rollout_pid=$!
  echo "rollout server: starting on ${hosts[0]} ($rollout_url), its log in $rollout_log" >&2
  "$PYTHON" -c 'import os, sys, time, urllib.request
deadline = time.monotonic() + float(sys.argv[3])
while time.monotonic() < deadline:
    try:
        os.kill(int(sys.argv[2]), 0)
    except ProcessLookupError:
        sys.exit("error: the rollout server exited before it answered")
    try:
        with urllib.request.urlopen(sys.argv[1] + "/health", timeout=5) as answer:
            if answer.status == 200:
                sys.exit(0)
    except OSError:
        pass
    time.sleep(2)
sys.exit(f"error: the rollout server did not answer {sys.argv[1]}/health within {sys.argv[3]} s")' \
    "$rollout_url" "$rollout_pid" "${ROLLOUT_START_TIMEOUT:-1800}" || {
    echo "$(tail -n 5 "$rollout_log")" >&2
    stop_rollout_server
    exit 1
  }
  echo "rollout server: ready at $rollout_url" >&2
}

stop_rollout_server() {
  [[ -n "${rollout_pid:-}" ]] || return 0
  kill -TERM "$rollout_pid" 2>/dev/null || true
  wait "$rollout_pid" 2>/dev/null || true
  rollout_pid=
  echo "rollout server: stopped" >&2
}

# A command line to read and to paste: words are quoted only where the shell needs it.
quote_cmd() {
  local word out=()
  for word in "$@"; do
    if [[ "$word" =~ ^[][A-Za-z0-9_./:=,@+%^-]+$ ]]; then out+=("$word"); else out+=("$(printf '%q' "$word")"); fi
  done
  echo "${out[*]}"
}

# The trainer's own validation, once, before torchrun (or srun) starts any rank: a bad option is one line and the
# exit status 2 from the batch shell, not the same line from every rank of every node followed by torchrun's
# ChildFailedError reports, after the job waited in the queue for its nodes.
# Its plan sizes the checkpoints, so it also checks that the save directory has room for those the run keeps, and the
# ranks need not plan them again (MIMESIS_SAVE_DIR_CHECKED=1, which a caller that checked it itself may set too), and,
# in a job that sets SHUTDOWN_TIMEOUT (the sbatch files), that it leaves the ranks the time this config needs to save
# on the pre-timeout signal: one sbatch file serves several configs. It asks every endpoint the run will call (an RL
# stage's user model, coach, judge, counterpart): one that does not answer would fail every request of the run.
check_config() {
  local save_dir=(--check-save-dir) shutdown=()
  if [[ "${MIMESIS_SAVE_DIR_CHECKED:-}" == 1 ]]; then save_dir=(); fi
  # the sbatch files give the ranks SHUTDOWN_TIMEOUT to save after the pre-timeout signal: enough for this config?
  if ((in_slurm)) && [[ -n "${SHUTDOWN_TIMEOUT:-}" ]]; then shutdown=(--check-shutdown-timeout "$SHUTDOWN_TIMEOUT"); fi
  WORLD_SIZE="$world_size" RANK=0 LOCAL_RANK=0 "$PYTHON" -m "$TRAIN_MODULE" --config "$CONFIG" \
    "${train_args[@]}" --dry-run --check-endpoints "${save_dir[@]}" "${shutdown[@]}" >/dev/null || exit $?
  export MIMESIS_SAVE_DIR_CHECKED=1
}

print_dry_run() {
  local name
  echo "== launch command"
  if ((in_slurm)); then
    echo "${srun_cmd[*]:0:${#srun_cmd[@]}-1} \"\$PER_NODE\""
    echo "PER_NODE=${node_cmd}"
    echo "rendezvous: a store the batch shell holds on $MASTER_ADDR:${MASTER_PORT:-PORT} for the job step" \
      "(PORT: one free on $MASTER_ADDR when the job starts, unless MASTER_PORT is exported)"
    echo "on SIGUSR1 (sbatch --signal=B:USR1@...): forwarded to the trainer, which saves; then scontrol requeue"
    if ((ROLLOUT_NODES)); then
      echo "rollout server (first, until $rollout_url/health answers): $(quote_cmd "${rollout_cmd[@]}")"
    fi
  else
    quote_cmd "${torchrun_cmd[@]}"
  fi
  echo "== environment"
  for name in "${env_names[@]}" MASTER_ADDR MASTER_PORT NNODES GPUS_PER_NODE; do
    if [[ -n "${!name:-}" ]]; then echo "$name=${!name}"; fi
  done
  # set but empty says something too: no GPU for the ranks (the demo on a machine with GPUs)
  if [[ -n "${CUDA_VISIBLE_DEVICES+set}" ]]; then echo "CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES"; fi
  echo "== trainer config ($CONFIG, world size $world_size)"
  WORLD_SIZE="$world_size" RANK=0 LOCAL_RANK=0 "$PYTHON" -m "$TRAIN_MODULE" --config "$CONFIG" \
    "${train_args[@]}" --dry-run
}

# The trainer's log directory (--log-dir, else the config's, else the trainer's default) and, in it, the record of
# a stop for requeue that rank 0 writes once its checkpoint is published (training/run_log.py).
exit_record() {
  local log_dir
  log_dir="$(flag_value --log-dir)"
  log_dir="${log_dir:-$(config_value log_dir)}"
  log_dir="${log_dir:-$("$PYTHON" -c 'from megatron_mimesis.training.config import TrainConfig; print(TrainConfig.log_dir)')}"
  echo "$log_dir/exit.json"
}

# The status a launch ends with: torchrun reports a preemption signal as a failure (exit 1 and a traceback) even
# after the ranks saved and left cleanly; a run whose record says its checkpoint was saved has been handled (0, one
# line). Anything else keeps torchrun's status, and a rank's recorded error is repeated as the last line, below
# torchrun's report of the failure.
launch_status() {
  local status="$1" record="$2" said
  ((status != 0)) || return 0
  [[ -f "$record" ]] || return "$status"
  said="$("$PYTHON" -c 'import json, sys
record = json.load(open(sys.argv[1]))
if record.get("saved"):
    print("preempted (%s): stopped at iteration %d with its checkpoint saved; exit 0 for the requeue"
          % (record.get("signal") or "a signal", record["iteration"]))
elif record.get("error"):
    print("failed (exit %s): %s" % (sys.argv[2], record["error"]))' "$record" "$status")" || return "$status"
  [[ -n "$said" ]] || return "$status"
  echo "$said" >&2
  [[ "$said" == preempted* ]] || return "$status"
}

# srun in the background so that the batch shell can take SIGUSR1 from `sbatch --signal=B:USR1@T`,
# forward it (srun relays it to every task: the torchrun agents, which pass it on to the trainer ranks),
# wait for the save, and requeue the job.
run_srun() {
  local srun_pid store_pid status=0 requeue=0 said=0
  if ((early_usr1)); then
    echo "SIGUSR1 before the ranks started: nothing to save; requeueing job $SLURM_JOB_ID" >&2
    scontrol requeue "$SLURM_JOB_ID"
    return 0
  fi
  start_rendezvous_store
  if ((ROLLOUT_NODES)); then start_rollout_server; fi
  "${srun_cmd[@]}" &
  srun_pid=$!
  trap 'requeue=1; echo "SIGUSR1: asking the trainer to checkpoint and stop" >&2; kill -USR1 "$srun_pid"' USR1
  # SIGTERM (scancel, an administrator's requeue, the end of the time limit) reaches every process of the job, the
  # ranks save on it: the batch shell waits for srun rather than dying first, so that the store outlives the agents
  trap 'echo "SIGTERM: the ranks save and stop" >&2' TERM
  if ((early_usr1)); then kill -USR1 "$srun_pid"; requeue=1; fi  # it came while srun was being started
  while true; do
    wait "$srun_pid" && status=0 || status=$?
    kill -0 "$srun_pid" 2>/dev/null || break
  done
  trap - USR1 TERM
  stop_rollout_server
  kill -KILL "$store_pid" 2>/dev/null || true
  launch_status "$status" "$record" || said=$?
  if ((requeue)); then  # last: the requeue ends this batch shell
    echo "requeueing job $SLURM_JOB_ID" >&2
    scontrol requeue "$SLURM_JOB_ID"
  fi
  return "$said"
}

# The torchrun agents' rendezvous store: a TCPStore server on this, the job's first node, for as long as the job step
# runs (the batch shell ends it after srun; SLURM ends it with the job). Its port is MASTER_PORT when exported, else
# one the kernel finds free on the node (a port derived from the job id can be in use: Linux hands out ports of the
# same range to outgoing connections); then the srun command is made with it.
start_rendezvous_store() {
  local port_file
  port_file="$(mktemp)"
  # it ignores the SIGTERM with which SLURM ends a job's processes (a cancel, a requeue): the agents still talk to it
  # while their ranks save; the batch shell kills it once srun has ended
  "$PYTHON" -c 'import datetime, signal, sys
signal.signal(signal.SIGTERM, signal.SIG_IGN)
signal.signal(signal.SIGINT, signal.SIG_IGN)
from torch.distributed import TCPStore
store = TCPStore("0.0.0.0", int(sys.argv[1]), is_master=True, wait_for_workers=False,
                 timeout=datetime.timedelta(days=30))
with open(sys.argv[2], "w") as f:
    f.write(f"{store.port}\n")
while True:
    signal.pause()' "${MASTER_PORT:-0}" "$port_file" 2>"$port_file.err" &
  store_pid=$!
  disown "$store_pid"  # its end (kill -KILL) is no news to report
  until [[ -s "$port_file" ]]; do
    kill -0 "$store_pid" 2>/dev/null || die "the rendezvous store did not start on $(hostname):" \
      "$(tail -n 1 "$port_file.err")"
    sleep 0.2
  done
  export MASTER_PORT="$(<"$port_file")"
  rm -f "$port_file" "$port_file.err"
  slurm_commands
}

# The per-node torchrun and the srun that starts one on every node of the job. The nodes meet at the store that the
# batch shell holds for the whole job step (start_rendezvous_store), not at one that node 0's torchrun holds: that one
# exits as soon as its exit barrier passes while the other nodes' are still reading it, and every multi-node run
# ended with their tracebacks (pytorch issue 69520).
slurm_commands() {
  node_cmd="$(quote_cmd "$PYTHON" -m megatron_mimesis.torchrun --nnodes "$NNODES" --nproc-per-node "$GPUS_PER_NODE" \
    --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:${MASTER_PORT:-PORT}" --rdzv-id "$SLURM_JOB_ID" \
    --rdzv-conf is_host=false "${signals[@]}" "${trainer[@]}")"
  # Job steps do not inherit the job's CPUs per task (Slurm >= 22.05): without this, each node's torchrun
  # and its ranks could be bound to a single core.
  local cpus=()
  if [[ -n "${SLURM_CPUS_ON_NODE:-}" ]]; then cpus=(--cpus-per-task="$SLURM_CPUS_ON_NODE"); fi
  # a split layout's trainer runs on the nodes after the rollout node
  local after_rollout=()
  if ((ROLLOUT_NODES)); then after_rollout=(--relative="$ROLLOUT_NODES"); fi
  srun_cmd=(srun --nodes="$NNODES" --ntasks="$NNODES" --ntasks-per-node=1 "${cpus[@]}" "${after_rollout[@]}"
    --kill-on-bad-exit=1 bash -c "$node_cmd")
}

run_demo_data() {
  local needed
  for needed in "${DEMO_NEEDS[@]}"; do
    [[ -e "$needed" ]] || die "$needed is missing; $DEMO_NEEDS_HINT"
  done
  ((${#DEMO_PREP_ARGS[@]} > 0)) || return 0
  local output=()
  if [[ -n "${DATA_PATH:-}" ]]; then output=(--output "$DATA_PATH"); fi
  echo "== building the embedded $STAGE dataset (reused when unchanged)"
  "$PYTHON" -m "data_prep.$STAGE" "${DEMO_PREP_ARGS[@]}" "${output[@]}"
}

# The demo's plot and its summary line, from the log directory the run used (--log-dir, else the config's), with
# the wall time since the launch began: the same figures the README quotes, so a run compares like with like.
report_demo() {
  local log_dir save summary elapsed=$((SECONDS - launch_start))
  log_dir="$(flag_value --log-dir)"
  log_dir="${log_dir:-$(config_value log_dir)}"
  save="$(flag_value --save)"
  save="${save:-$(config_value save)}"
  local metrics="$log_dir/metrics.jsonl" plot="$log_dir/loss.png"
  summary="$("$PYTHON" tools/plot_run.py "$metrics" -o "$plot" --summary "${DEMO_PLOT_ARGS[@]}" | tail -n 1)"
  echo "== demo $STAGE finished"
  echo "logs:        $metrics (TensorBoard: $log_dir)"
  if [[ -n "$save" && -e "$save/latest" ]]; then echo "checkpoint:  $save"; fi
  echo "plot:        $plot"
  echo "summary:     $summary; wall $((elapsed / 60)) min $((elapsed % 60)) s"
}

# The RL demos (rl_simulator.sh, rl_agent.sh) build no data of their own: they start from the mid-training
# demo's checkpoint and tokenizer and plot the mean reward.
rl_demo_defaults() {
  DEMO_PREP_ARGS=()
  DEMO_NEEDS=(runs/demo-midtrain/checkpoints/latest .cache/data/chitchat-midtrain/tokenizer/tokenizer.json)
  DEMO_NEEDS_HINT="run bash launch/midtrain.sh first (the RL demo starts from its checkpoint and tokenizer)"
  DEMO_PLOT_ARGS=(--metric reward_mean --speed rollout_time_s)
}

launch() {
  launch_start=$SECONDS
  cd "$REPO_ROOT" || die "cannot enter $REPO_ROOT"
  if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
  fi

  local arg dry_run=0 demo=0 gpus
  train_args=()
  ROLLOUT_NODES="${ROLLOUT_NODES:-0}"
  for arg in "$@"; do
    if [[ "$arg" == --dry-run ]]; then dry_run=1; else train_args+=("$arg"); fi
  done
  in_slurm=0
  early_usr1=0
  if [[ -n "${SLURM_JOB_ID:-}" ]]; then
    in_slurm=1
    # SLURM's pre-timeout signal may come before srun starts (a short limit, a slow start): noted from the start, so
    # that the batch shell does not die of it; with nothing trained yet, the job is then requeued as it is (run_srun)
    trap 'early_usr1=1' USR1
  fi
  if ((ROLLOUT_NODES)) && ! ((in_slurm)); then
    die "ROLLOUT_NODES=$ROLLOUT_NODES: the split layout is a SLURM job's; elsewhere start a vLLM server of the policy" \
      "(VLLM_SERVER_DEV_MODE=1) and pass --engine served --engine-options '{\"base_url\": ...}'"
  fi
  gpus="$(gpu_count)"
  local chosen="from CONFIG"
  if [[ -z "${CONFIG:-}" ]]; then
    if ((in_slurm)); then
      CONFIG="$PAPER_CONFIG" chosen="the paper's run; CONFIG=<config.yaml> runs another"
    else
      CONFIG="$DEMO_CONFIG" chosen="the CPU demo; CONFIG=<config.yaml> runs another"
    fi
  fi
  [[ -n "$CONFIG" ]] || die "set CONFIG=<your $STAGE config.yaml> (this stage ships no paper-scale config yet)"
  [[ -f "$CONFIG" ]] || die "CONFIG=$CONFIG: no such file"
  echo "== $STAGE: $CONFIG ($chosen)"
  # the demo configs are CPU configs (gloo, the tiny presets): on a machine with GPUs they run as on one without, so
  # that `make demo` gives the same run everywhere
  if [[ "$CONFIG" == "$DEMO_CONFIG" && $in_slurm == 0 ]]; then
    gpus=0
    export CUDA_VISIBLE_DEVICES=""
  fi
  # a stage of a pipeline (MIMESIS_DEMO=0) runs a demo config on the data and checkpoints it is handed and reports
  # itself, so the launcher builds no demo data and prints no demo summary
  if [[ "$CONFIG" == "$DEMO_CONFIG" && $in_slurm == 0 && "${MIMESIS_DEMO:-1}" != 0 ]]; then demo=1; fi
  add_env_flags

  local trainer=(-m "$TRAIN_MODULE" --config "$CONFIG" "${train_args[@]}")
  # torchrun forwards these to the ranks (SIGUSR1: SLURM's pre-timeout warning) and gives them
  # SHUTDOWN_TIMEOUT seconds to finish the step and save before it kills them.
  local signals=(--signals-to-handle "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
    --shutdown-timeout "${SHUTDOWN_TIMEOUT:-300}")
  if ((in_slurm)); then
    local hosts
    mapfile -t hosts < <(scontrol show hostnames "${SLURM_JOB_NODELIST:?SLURM_JOB_NODELIST is not set}")
    ((${#hosts[@]} > 0)) || die "scontrol show hostnames $SLURM_JOB_NODELIST gave no hosts"
    if ((ROLLOUT_NODES)); then rollout_side; fi
    export MASTER_ADDR="${MASTER_ADDR:-$(node_address "${hosts[ROLLOUT_NODES]}")}"
    export NNODES="${NNODES:-$((${SLURM_NNODES:-${#hosts[@]}} - ROLLOUT_NODES))}"
    local allocated="${SLURM_GPUS_ON_NODE:-0}"
    if ((allocated > 0 || gpus > 0)); then
      export GPUS_PER_NODE="${GPUS_PER_NODE:-${NPROC:-$((allocated > 0 ? allocated : gpus))}}"
      gpus_per_node="$GPUS_PER_NODE"
      set_gpu_env
    else  # a CPU node (no GPU allocated or visible): gloo ranks, one per allocated task unless NPROC says otherwise
      export GPUS_PER_NODE="${GPUS_PER_NODE:-${NPROC:-$(slurm_tasks_per_node)}}"
      gpus_per_node="$GPUS_PER_NODE"
      set_slurm_cpu_env
    fi
    world_size=$((NNODES * GPUS_PER_NODE))
    slurm_commands  # made again once the rendezvous store has its port (start_rendezvous_store)
  else
    local nproc="${NPROC:-${GPUS_PER_NODE:-$((gpus > 0 ? gpus : 2))}}"
    export NNODES="${NNODES:-1}"
    gpus_per_node="$nproc"
    if ((gpus > 0)); then set_gpu_env; else set_cpu_env; fi
    world_size=$((NNODES * nproc))
    local rendezvous=(--standalone --nnodes 1)
    if ((NNODES > 1)); then
      rendezvous=(--nnodes "$NNODES" --node-rank "${NODE_RANK:?set NODE_RANK for a multi-node run without SLURM}"
        --master-addr "${MASTER_ADDR:?set MASTER_ADDR for a multi-node run without SLURM}"
        --master-port "${MASTER_PORT:-29500}")
    fi
    torchrun_cmd=("$PYTHON" -m megatron_mimesis.torchrun "${rendezvous[@]}" --nproc-per-node "$nproc"
      "${signals[@]}" "${trainer[@]}")
  fi

  if ((dry_run)); then
    print_dry_run
    return 0
  fi
  record="$(exit_record)"
  rm -f "$record"
  if ((in_slurm)); then
    check_config
    run_srun
    return
  fi
  if ((demo)); then run_demo_data; fi
  check_config
  local status=0
  "${torchrun_cmd[@]}" || status=$?
  launch_status "$status" "$record" || return
  if ((demo)); then report_demo; fi
}
