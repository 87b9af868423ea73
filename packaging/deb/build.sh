#!/usr/bin/env bash
# Builds target/debian/playguard_<version>-1_<arch>.deb. cargo-deb takes only files that exist
# when it starts, so this builds the binary first (the release profile, as benchmarked), has it
# print its completions and man pages (`playguard completions SHELL`, `playguard man DIR`) into
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
rm -rf "$out/man" && mkdir "$out/man"
"$bin" man "$out/man"
gzip -9n "$out"/man/*.1
# Stripped: the benchmarks keep the release profile's line tables, the package need not.
cargo deb --locked --no-build --strip "$@"
