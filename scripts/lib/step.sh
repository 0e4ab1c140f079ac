# shellcheck shell=bash
# Install and build steps with their output in a log file, one per step, and one line each on
# the terminal. Sourced by the scripts:
#   source scripts/lib/step.sh
#   step_setup PREFIX LOG_DIR [FD]    # FD: where the step lines go, 1 (stdout, default) or 2
#   step NAME DOING DONE COMMAND [ARG…]
# `step` runs COMMAND (a program or a shell function) with errexit on, without input, its stdout
# and stderr in LOG_DIR/NAME.log, then prints `PREFIX: DONE (TIME)`, e.g. `demo: seedlock built
# (41s)`. While it runs, `PREFIX: DOING…` is on the line if FD is a terminal, and is replaced by
# the DONE line; STEP_ANNOUNCE=always prints `PREFIX: DOING… (log: PATH)` as a line of its own,
# terminal or not (for scripts whose callers print no log directory of their own).
# When COMMAND fails: the last STEP_TAIL (20) lines of its log and the log's path on stderr, and
# `step` returns COMMAND's status. A step inside a step (a script that uses `step`, run as a step)
# shows 5 lines fewer, so that the outer step's end of log holds the inner one's whole report.
# Call `step` as a plain command, not after `if`, `||` or `&&` (bash turns errexit off inside
# those, in COMMAND too); under `set -e` a failed step stops the script with COMMAND's status.

STEP_PREFIX="${STEP_PREFIX:-step}"
STEP_LOG_DIR="${STEP_LOG_DIR:-.}"
STEP_FD="${STEP_FD:-1}"
STEP_ANNOUNCE="${STEP_ANNOUNCE:-tty}"
STEP_TAIL="${STEP_TAIL:-20}"

step_setup() {
  STEP_PREFIX="$1"
  STEP_LOG_DIR="$2"
  STEP_FD="${3:-1}"
}

# 41s, 4m 8s, 1h 2m.
step_duration() {
  local s="$1"
  if (( s < 60 )); then
    printf '%ds' "$s"
  elif (( s < 3600 )); then
    printf '%dm %ds' $((s / 60)) $((s % 60))
  else
    printf '%dh %dm' $((s / 3600)) $((s % 3600 / 60))
  fi
}

step() {
  local name="$1" doing="$2" done_msg="$3"
  shift 3
  local log="$STEP_LOG_DIR/$name.log"
  mkdir -p "$STEP_LOG_DIR"
  local live=false
  if [[ "$STEP_ANNOUNCE" == always ]]; then
    printf '%s: %s… (log: %s)\n' "$STEP_PREFIX" "$doing" "$log" >&"$STEP_FD"
  elif [[ -t "$STEP_FD" ]]; then
    # Cut to the terminal's width: a line that wraps would not be erased whole.
    live=true
    local line="$STEP_PREFIX: $doing…" cols
    cols="$(tput cols 2>/dev/null || true)"
    [[ "$cols" =~ ^[0-9]+$ ]] || cols=80
    (( ${#line} < cols )) || line="${line:0:cols-2}…"
    printf '%s' "$line" >&"$STEP_FD"
  fi

  local start=$SECONDS status errexit=false
  [[ $- == *e* ]] && errexit=true
  set +e
  ( set -e; STEP_INSIDE=1 "$@" ) </dev/null >"$log" 2>&1
  status=$?
  $errexit && set -e
  local took tail_lines="$STEP_TAIL"
  took="$(step_duration $((SECONDS - start)))"
  [[ -n "${STEP_INSIDE:-}" ]] && tail_lines=$((tail_lines - 5))

  if $live; then printf '\r\033[K' >&"$STEP_FD"; fi
  if (( status == 0 )); then
    printf '%s: %s (%s)\n' "$STEP_PREFIX" "$done_msg" "$took" >&"$STEP_FD"
    return 0
  fi
  {
    echo "$STEP_PREFIX: failed after $took (exit $status): $doing"
    if [[ -s "$log" ]]; then
      echo "$STEP_PREFIX: the last lines of its log:"
      tail -n "$tail_lines" "$log" | sed 's/^/    /'
    else
      echo "$STEP_PREFIX: its log is empty"
    fi
    echo "$STEP_PREFIX: log: $log"
  } >&2
  return "$status"
}
