#!/usr/bin/env bash
# Re-make tests/fixtures/templates/ollama-go.json: rtune's Ollama templates rendered by Go's own
# text/template (Debian: `apt-get install golang-go`), which the unit test
# export::ollama::tests::go_renders_as_rtune_does checks rtune's renderer against.
set -euo pipefail
cd "$(dirname "$0")/../.."
cases=$(mktemp)
trap 'rm -f "$cases"' EXIT
# The test writes the cases it checks when asked (and fails while the fixture is stale).
RTUNE_OLLAMA_CASES="$cases" cargo test -q --lib export::ollama::tests::go_renders_as_rtune_does >/dev/null 2>&1 || true
test -s "$cases" || { echo "the test wrote no cases" >&2; exit 1; }
go run scripts/interop/ollama-templates.go <"$cases" >tests/fixtures/templates/ollama-go.json
cargo test -q --lib export::ollama::tests::go_renders_as_rtune_does
echo "tests/fixtures/templates/ollama-go.json re-made with $(go version)"
