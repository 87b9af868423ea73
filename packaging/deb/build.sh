#!/usr/bin/env bash
# Builds target/debian/playguard_<version>-1_<arch>.deb. cargo-deb takes only files that exist
# when it starts, so this builds the binary first (the release profile, as benchmarked), has it
# print its completions and man page (`playguard completions SHELL`, `playguard man`) into
# target/deb-assets/, then packages both with `cargo deb --no-build`.
set -euo pipefail
cd "$(dirname "$0")/../.."
cargo build --locked --release --bin playguard
bin=target/release/playguard
out=target/deb-assets
mkdir -p "$out"
for shell in bash zsh fish; do
  "$bin" completions "$shell" > "$out/playguard.$shell"
done
"$bin" man | gzip -9n > "$out/playguard.1.gz"
# Stripped: the benchmarks keep the release profile's line tables, the package need not.
cargo deb --locked --no-build --strip "$@"
