# Sourced by run.sh, profile.sh and scale.sh: the release build (unless SKIP_BUILD), a private
# redis-server on a free loopback port (never 6379; `redis_wrap` may prefix its command, e.g.
# callgrind; `@OUT@` in it becomes the output folder), stopped by PID when the script exits. Sets bin, port, out, redis_pid.
bench_root="$(dirname "$here")"
cd "$bench_root"
if [ -z "${SKIP_BUILD:-}" ]; then
  cargo build --release --example bench_worker --example spawn_floor
fi
bin="${PG_BIN:-${CARGO_TARGET_DIR:-$bench_root/target}/release/examples/bench_worker}"
[ -x "$bin" ] || { echo "missing $bin" >&2; exit 1; }
port="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')"
[ "$port" != 6379 ] || { echo "refusing port 6379" >&2; exit 1; }
out="${OUT_DIR:-$(mktemp -d "/tmp/playguard-$1.XXXXXX")}"
redis_wrap=("${redis_wrap[@]//@OUT@/$out}")
"${redis_wrap[@]}" redis-server --port "$port" --bind 127.0.0.1 --save '' --appendonly no \
  --daemonize no >"$out/redis.log" 2>&1 &
redis_pid=$!
trap 'kill "$redis_pid" 2>/dev/null || true; wait "$redis_pid" 2>/dev/null || true' EXIT
for _ in $(seq 1 200); do
  redis-cli -p "$port" ping >/dev/null 2>&1 && break
  sleep 0.05
done
redis-cli -p "$port" ping >/dev/null
export REDIS_PID="$redis_pid"
