# Shared by the demo phase scripts: the Marquee id and its local work folder.
set -eu
# PLAYGUARD_ARGS is ["<id>"] or [<id>]. The id becomes part of file paths (and would become a
# host name over SSH): only a plain identifier is accepted, never a path or shell text.
marquee=${PLAYGUARD_ARGS:-[]}
marquee=${marquee#"["}; marquee=${marquee%"]"}
marquee=${marquee#'"'}; marquee=${marquee%'"'}
case $marquee in
  '' | *[!A-Za-z0-9_-]*)
    echo "bad Marquee id in PLAYGUARD_ARGS ${PLAYGUARD_ARGS:-(unset)}: want one plain identifier (letters, digits, _ and -)" >&2
    exit 2 ;;
esac
demo=${PLAYGUARD_DEMO_DIR:-/tmp/playguard-demo}
home="$demo/marquee-$marquee"
mkdir -p "$home"
say() { echo "marquee=$marquee fence=${PLAYGUARD_FENCE:-?} $*"; }
