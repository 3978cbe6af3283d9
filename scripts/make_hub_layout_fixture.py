#!/usr/bin/env python3
"""Download a repo with huggingface_hub into a fresh cache, to record the layout it produces.

Run through the ignored test that starts the local Hub and writes the fixture listing:

    cargo test --test hub -- --ignored python_layout

(needs `pip install huggingface_hub`). The test lists the cache this script fills into
tests/fixtures/hub/python-layout.txt; `download_produces_the_same_cache_layout_as_huggingface_hub`
then checks that `rtune download` produces exactly the same files, refs and symlinks.
"""
import argparse
import os

parser = argparse.ArgumentParser()
parser.add_argument("--endpoint", required=True)
parser.add_argument("--cache", required=True)
parser.add_argument("--repo", required=True)
args = parser.parse_args()

os.environ["HF_ENDPOINT"] = args.endpoint
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
os.environ["HF_HUB_DISABLE_XET"] = "1"

import huggingface_hub  # noqa: E402

path = huggingface_hub.snapshot_download(args.repo, cache_dir=args.cache, endpoint=args.endpoint)
print(f"huggingface_hub {huggingface_hub.__version__}: {path}")
