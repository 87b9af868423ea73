# Shared by the demo phase scripts: the Marquee id and its local work folder.
set -eu
marquee=$(printf '%s' "${PLAYGUARD_ARGS:-[]}" | tr -d '[]" ')
[ -n "$marquee" ] || { echo "no Marquee id in PLAYGUARD_ARGS" >&2; exit 2; }
demo=${PLAYGUARD_DEMO_DIR:-/tmp/playguard-demo}
home="$demo/marquee-$marquee"
mkdir -p "$home"
say() { echo "marquee=$marquee fence=${PLAYGUARD_FENCE:-?} $*"; }
