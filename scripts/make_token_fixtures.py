#!/usr/bin/env python3
"""Expected token ids and loss masks for each dataset format, computed independently of rtune
with the Python `tokenizers` library and `jinja2` (as transformers renders chat templates).

    python3 scripts/make_token_fixtures.py      # rewrites tests/fixtures/tokens/

Writes a byte-level BPE tokenizer trained here (tokenizer.json), a tokenizer_config.json with
Meta-Llama-3-Instruct's chat template, the rows (alpaca.jsonl, text.jsonl, chat.jsonl) and
expected.json; `cargo test --test data` checks rtune's tokenize against them.
"""
import json
from pathlib import Path

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests/fixtures/tokens"
OUT.mkdir(parents=True, exist_ok=True)

ALPACA_WITH_INPUT = "Below is an instruction that describes a task, paired with an input that provides further context. Write a response that appropriately completes the request.\n\n### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
ALPACA_NO_INPUT = "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n"
LLAMA3_TEMPLATE = "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]

alpaca = [json.loads(l) for l in (ROOT / "tests/fixtures/data/tiny-alpaca.jsonl").read_text().splitlines()[:6]]
texts = [{"text": "The quick brown fox jumps over the lazy dog."}, {"text": "Ünïcödé and emoji 🦀 survive byte-level BPE."}, {"text": "  leading spaces\nand a second line"}]
chats = [
    {"messages": [{"role": "user", "content": "What is two plus three?"}, {"role": "assistant", "content": "Five."}]},
    {"messages": [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": " Blue. "}, {"role": "user", "content": "Another?"}, {"role": "assistant", "content": "Green."}]},
    {"messages": [{"role": "user", "content": "Translate 'cat' to French."}, {"role": "assistant", "content": "chat"}]},
]

# Train the tokenizer on the alpaca rows and the other texts.
corpus = [r["instruction"] + "\n" + r.get("input", "") + "\n" + r["output"] for r in alpaca] + [t["text"] for t in texts]
corpus += [m["content"] for c in chats for m in c["messages"]]
tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
tok.train_from_iterator(corpus * 5, trainer)
bos = tok.token_to_id("<|begin_of_text|>")
eos = tok.token_to_id("<|end_of_text|>")
tok.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", bos)])
tok.save(str(OUT / "tokenizer.json"))
(OUT / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", "chat_template": LLAMA3_TEMPLATE}, indent=2) + "\n")

for name, rows in [("alpaca", alpaca), ("text", texts), ("chat", chats)]:
    (OUT / f"{name}.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))

expected = {"bos": bos, "eos": eos, "alpaca": [], "text": [], "chat": []}
for r in alpaca:
    prompt = (ALPACA_WITH_INPUT if r.get("input", "").strip() else ALPACA_NO_INPUT).format(instruction=r["instruction"], input=r.get("input", ""))
    p = tok.encode(prompt, add_special_tokens=False).ids
    o = tok.encode(r["output"], add_special_tokens=False).ids
    expected["alpaca"].append({"ids": [bos] + p + o + [eos], "mask": [0] * (1 + len(p)) + [1] * (len(o) + 1)})
for t in texts:
    ids = tok.encode(t["text"]).ids
    expected["text"].append({"ids": ids, "mask": [1] * len(ids)})

env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
template = env.from_string(LLAMA3_TEMPLATE)
def render(msgs, gen):
    return template.render(messages=msgs, add_generation_prompt=gen, bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>")
for c in chats:
    msgs = c["messages"]
    full = render(msgs, False)
    spans = []
    for i, m in enumerate(msgs):
        if m["role"] == "assistant":
            a, b = render(msgs[:i], True).encode(), render(msgs[: i + 1], False).encode()
            assert full.encode().startswith(b) and b.startswith(a)
            spans.append((len(a), len(b)))
    enc = tok.encode(full, add_special_tokens=False)
    # Python offsets are in characters; rtune's are in bytes: convert.
    starts = [len(full[:s].encode()) for s, e in enc.offsets]
    ends = [len(full[:e].encode()) for s, e in enc.offsets]
    mask = [int(e > s and any(a <= s < b for a, b in spans)) for s, e in zip(starts, ends)]
    expected["chat"].append({"ids": enc.ids, "mask": mask, "text": full})
(OUT / "expected.json").write_text(json.dumps(expected) + "\n")
print("wrote", OUT)

# The same chat rows as Parquet (snappy, list<struct<role, content>>), as Hub datasets ship them.
import pyarrow as pa
import pyarrow.parquet as pq

pq.write_table(pa.Table.from_pylist(chats), OUT / "chat.parquet", compression="snappy")
pq.write_table(pa.Table.from_pylist(alpaca), OUT / "alpaca.parquet", compression="zstd")
