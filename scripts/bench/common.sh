# Shared by the benchmark scripts: a database (MONGODB_URI, or the test server started here and
# stopped on exit), the release binaries, and a header line naming the machine and the server.
server_pid=""; server_storage=""
bench_cleanup() {
  [[ -n "$server_pid" ]] && { kill "$server_pid" 2>/dev/null || true; wait "$server_pid" 2>/dev/null || true; }
  [[ -n "$server_storage" ]] && rm -rf "$server_storage"
  return 0
}
bench_setup() {
  trap bench_cleanup EXIT
  if [[ -z "${MONGODB_URI:-}" ]]; then
    read -r server_pid MONGODB_URI server_storage < <(scripts/test-server)
    export MONGODB_URI
  fi
  cargo build --release --quiet --bin seedlock --example lock_bench --example crawl_bench
  # Another build measured by the same script: SEEDLOCK_BIN=PATH (the header names it).
  export SEEDLOCK_BIN="${SEEDLOCK_BIN:-$PWD/target/release/seedlock}"
  mkdir -p target/bench
}
bench_header() {
  local server="MONGODB_URI"
  [[ -n "$server_pid" ]] && server="SecantusDB secantusd-rs 0.5.3-beta.196 (scripts/test-server)"
  local build=""
  [[ "$SEEDLOCK_BIN" != "$PWD/target/release/seedlock" ]] && build="; seedlock: $SEEDLOCK_BIN"
  echo "Machine: $(nproc) cores, $(free -g | awk '/Mem:/ {print $2}') GiB RAM; server: $server$build; $(date -u +%F)"
  echo
}
