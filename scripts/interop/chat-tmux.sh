#!/usr/bin/env bash
# Drive `rtune chat` in a real terminal (tmux send-keys / capture-pane): the greeting, a reply
# streamed after the prompt, a second turn, `/reset`, the first reply again, `/exit`.
# Usage: scripts/interop/chat-tmux.sh [RTUNE_BINARY] (default target/debug/rtune, built first).
# Prints each captured screen; exits 1 if the terminal does not show what it should.
set -euo pipefail
cd "$(dirname "$0")/../.."
bin=${1:-target/debug/rtune}
[ "$#" -gt 0 ] || cargo build -q
model=tests/fixtures/chat/tiny-alpaca
session=rtune-chat-$$
trap 'tmux kill-session -t "$session" 2>/dev/null || true' EXIT
tmux new-session -d -s "$session" -x 160 -y 40 "RTUNE_NO_PROGRESS=1 $bin chat $model --max-new-tokens 12; echo '[chat exited]'; sleep 30"
screen() { tmux capture-pane -p -t "$session"; }
wait_for() { # TEXT: wait until the pane shows it (10 s at most)
  for _ in $(seq 100); do screen | grep -qF -- "$1" && return 0; sleep 0.1; done
  echo "the terminal never showed: $1" >&2; screen >&2; exit 1
}
say() { tmux send-keys -t "$session" -l -- "$1"; tmux send-keys -t "$session" Enter; }
wait_for "/reset starts over"
say "Name a colour."
wait_for "TheThe capital of Snow is puy"
echo "--- after the first turn"; screen
say "Name another one."
wait_for "Name another one."
sleep 0.5
say "/reset"
wait_for "conversation reset"
say "Name a colour."
sleep 1
echo "--- after /reset and the first prompt again"; screen
# The first reply appears twice: once before /reset, once after it.
[ "$(screen | grep -cF 'TheThe capital of Snow is puy')" -eq 2 ] || { echo "/reset did not start over" >&2; exit 1; }
say "/exit"
wait_for "[chat exited]"
echo "--- after /exit"; screen
echo "ok: the terminal chat answered, reset and exited"
