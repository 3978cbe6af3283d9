//! Dataset formats: rows → token ids and loss masks.
//!
//! - `alpaca`: the Stanford Alpaca prompt (with or without `### Input:`), encoded as
//!   `[bos] + encode(prompt) + encode(output) + [eos]` without the tokenizer's special tokens,
//!   where `bos` is there only if the tokenizer puts one in front of text
//!   ([`crate::model::ModelFolder::row_bos`]);
//!   bos and prompt are masked from the loss unless `train_on_prompt`.
//! - `text`: the `text` column encoded with the tokenizer's post-processor; every token counts.
//! - `chat`: the `messages` column (a list of `{role, content}`; or ShareGPT's `conversations`,
//!   see [`conversation`]) rendered with the model's chat template ([`super::chat`]) and encoded
//!   without added special tokens (the template writes them); only the assistant turns (with the
//!   template's end-of-turn marker) count.
//!
//! `mask[j] = 1` means token j is a training target (predicted from position j − 1).

use std::collections::BTreeMap;

use serde_json::Value;
use tokenizers::Tokenizer;

use super::{DataError, Row};
use crate::recipe::DataFormat;

pub const ALPACA_WITH_INPUT: &str = "Below is an instruction that describes a task, paired with an input that provides further context. Write a response that appropriately completes the request.\n\n### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n";
pub const ALPACA_NO_INPUT: &str = "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n";

/// The Alpaca prompt for an instruction and (possibly empty) input.
pub fn alpaca_prompt(instruction: &str, input: &str) -> String {
    if input.trim().is_empty() {
        ALPACA_NO_INPUT.replace("{instruction}", instruction)
    } else {
        ALPACA_WITH_INPUT.replace("{instruction}", instruction).replace("{input}", input)
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Encoded {
    pub ids: Vec<u32>,
    pub mask: Vec<u8>,
    pub prompt_tokens: usize,
    pub response_tokens: usize,
    pub truncated: bool,
}

/// A rendered conversation, its messages and tools (the assistant spans are found after tokenizing).
type Rendered = (String, (Vec<Value>, Option<Value>));

/// A row's conversation: the column `column_map` names for `messages`, else `messages` (each
/// message whole, as transformers passes it), else ShareGPT's `conversations` of `{from, value}`
/// turns as `{role, content}`, whose speakers are named as Unsloth's `standardize_sharegpt`
/// reads them (`human`, `input` → user; `gpt`, `output` → assistant; others as written).
/// `Err((message, help))` says what is wrong.
pub fn conversation(row: &Row, column_map: &BTreeMap<String, String>) -> Result<Vec<Value>, (String, Option<String>)> {
    let mapped = column_map.get("messages").map(String::as_str);
    let (col, msgs) = match (mapped, row.fields.get(mapped.unwrap_or("messages"))) {
        (_, Some(v)) => (mapped.unwrap_or("messages"), v),
        (None, None) => match row.fields.get("conversations") {
            Some(v) => ("conversations", v),
            None => {
                return Err((
                    "row has no `messages` column (nor ShareGPT's `conversations`)".into(),
                    Some("map it with `[dataset] column_map = { messages = \"…\" }`".into()),
                ));
            }
        },
        (Some(col), None) => {
            return Err((format!("row has no `{col}` column"), Some("check `[dataset] column_map`".into())));
        }
    };
    let Value::Array(msgs) = msgs else {
        return Err((format!("`{col}` must be a list of messages, found {}", super::source::kind(msgs)), None));
    };
    msgs.iter()
        .enumerate()
        .map(|(i, m)| {
            let (role, content) = match (&m["role"], &m["content"], &m["from"], &m["value"]) {
                // The message as it is, every key included (`tool_calls`, `name`,
                // `tool_call_id`, …), as transformers hands it to the template; `content` may
                // be missing or null where a reply is only tool calls.
                (Value::String(_), Value::String(_) | Value::Null, _, _) if m.is_object() => return Ok(m.clone()),
                (Value::String(r), Value::String(c), _, _) => (r.as_str(), c),
                (Value::Null, Value::Null, Value::String(from), Value::String(v)) => (
                    match from.as_str() {
                        "human" | "input" => "user",
                        "gpt" | "output" => "assistant",
                        other => other,
                    },
                    v,
                ),
                _ => {
                    return Err((
                        format!("message {i} of `{col}` must have a string `role` and a string (or null) `content` (or ShareGPT's `from` and `value`)"),
                        Some("messages look like {\"role\": \"user\", \"content\": \"…\"}".into()),
                    ));
                }
            };
            Ok(serde_json::json!({ "role": role, "content": content }))
        })
        .collect()
}

/// A chat row's tool schemas (the `tools` column, or the one `column_map` names for it), for
/// the template's `tools` as `apply_chat_template(…, tools=…)` takes them: a list, or a JSON
/// string holding one (as xLAM-style datasets store it); none when the column is null, or absent
/// and not named by `column_map`.
pub fn tools(row: &Row, column_map: &BTreeMap<String, String>) -> Result<Option<Value>, (String, Option<String>)> {
    let mapped = column_map.get("tools").map(String::as_str);
    let col = mapped.unwrap_or("tools");
    match row.fields.get(col) {
        // A column the recipe names must be there (a misspelt name would train without tools).
        None if mapped.is_some() => {
            Err((format!("row has no `{col}` column"), Some("check `[dataset] column_map`".into())))
        }
        None | Some(Value::Null) => Ok(None),
        Some(v @ Value::Array(_)) => Ok(Some(v.clone())),
        Some(Value::String(s)) if s.trim().is_empty() => Ok(None),
        Some(Value::String(s)) => match serde_json::from_str::<Value>(s) {
            Ok(v @ Value::Array(_)) => Ok(Some(v)),
            Ok(Value::Null) => Ok(None),
            Ok(other) => {
                Err((format!("`{col}` must hold a list of tools, found {}", super::source::kind(&other)), None))
            }
            Err(e) => Err((
                format!("`{col}` is a string that is not JSON: {e}"),
                Some("tools are a list of JSON schemas, or a JSON string holding that list".into()),
            )),
        },
        Some(other) => Err((format!("`{col}` must be a list of tools, found {}", super::source::kind(other)), None)),
    }
}

pub struct Renderer<'a> {
    pub tokenizer: &'a Tokenizer,
    pub format: DataFormat,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    pub max_seq_len: usize,
    pub truncate: bool,
    pub train_on_prompt: bool,
    /// format field → source column.
    pub column_map: &'a BTreeMap<String, String>,
    /// The chat template (`chat` format only).
    pub chat: Option<&'a super::chat::ChatTemplate>,
}

impl Renderer<'_> {
    fn field<'r>(&self, row: &'r Row, name: &str, required: bool) -> Result<Option<&'r str>, DataError> {
        let col = self.column_map.get(name).map(String::as_str).unwrap_or(name);
        match row.fields.get(col) {
            Some(Value::String(s)) => Ok(Some(s)),
            Some(Value::Null) | None if !required => Ok(None),
            None | Some(Value::Null) => {
                let mut cols: Vec<&String> = row.fields.keys().collect();
                cols.sort();
                Err(DataError::bad_row(
                    &row.file,
                    row.line,
                    &Value::Object(row.fields.clone()).to_string(),
                    None,
                    format!("row has no `{col}` column"),
                    Some(format!(
                        "the row has {}; map a column with `[dataset] column_map = {{ {name} = \"…\" }}`",
                        cols.iter().map(|c| format!("`{c}`")).collect::<Vec<_>>().join(", ")
                    )),
                ))
            }
            Some(other) => Err(DataError::bad_row(
                &row.file,
                row.line,
                &other.to_string(),
                None,
                format!("`{col}` must be a string, found {}", super::source::kind(other)),
                None,
            )),
        }
    }

    /// Encode rows in parallel (the tokenizer's batch API). One result per row.
    pub fn encode(&self, rows: &[Row]) -> Result<Vec<Result<Encoded, DataError>>, DataError> {
        match self.format {
            DataFormat::Alpaca => self.encode_alpaca(rows),
            DataFormat::Text => self.encode_text(rows),
            DataFormat::Chat => self.encode_chat(rows),
        }
    }

    fn encode_alpaca(&self, rows: &[Row]) -> Result<Vec<Result<Encoded, DataError>>, DataError> {
        let mut texts: Vec<Result<(String, String), DataError>> = Vec::with_capacity(rows.len());
        for row in rows {
            let r = (|| {
                let instruction = self.field(row, "instruction", true)?.unwrap_or_default();
                let input = self.field(row, "input", false)?.unwrap_or_default();
                let output = self.field(row, "output", true)?.unwrap_or_default();
                Ok((alpaca_prompt(instruction, input), output.to_string()))
            })();
            texts.push(r);
        }
        let ok: Vec<&(String, String)> = texts.iter().filter_map(|t| t.as_ref().ok()).collect();
        let prompts = self.batch(ok.iter().map(|(p, _)| p.as_str()).collect(), false)?;
        let outputs = self.batch(ok.iter().map(|(_, o)| o.as_str()).collect(), false)?;
        let mut enc = prompts.into_iter().zip(outputs);
        let mut out = Vec::with_capacity(rows.len());
        for (row, t) in rows.iter().zip(texts) {
            let r = t.and_then(|_| {
                let (p, o) = enc.next().expect("one encoding per valid row");
                let mut ids = Vec::with_capacity(p.len() + o.len() + 2);
                ids.extend(self.bos);
                ids.extend(&p);
                let prompt_len = ids.len();
                ids.extend(&o);
                ids.extend(self.eos);
                let mut mask = vec![u8::from(self.train_on_prompt); prompt_len];
                mask.resize(ids.len(), 1);
                self.finish(row, ids, mask, prompt_len)
            });
            out.push(r);
        }
        Ok(out)
    }

    fn encode_chat(&self, rows: &[Row]) -> Result<Vec<Result<Encoded, DataError>>, DataError> {
        let template = self.chat.ok_or_else(|| DataError::Invalid {
            message: "the `chat` format needs a chat template".into(),
            help: Some("set `[dataset] chat_template = \"chatml\"`".into()),
        })?;
        let bad = |row: &Row, msg: String, help: Option<String>| {
            DataError::bad_row(&row.file, row.line, &Value::Object(row.fields.clone()).to_string(), None, msg, help)
        };
        let rendered: Vec<Result<Rendered, DataError>> = rows
            .iter()
            .map(|row| {
                let msgs = conversation(row, self.column_map).map_err(|(msg, help)| bad(row, msg, help))?;
                let tools = tools(row, self.column_map).map_err(|(msg, help)| bad(row, msg, help))?;
                if !msgs.iter().any(|m| m["role"] == "assistant") {
                    return Err(bad(row, "the conversation has no assistant message to learn from".into(), None));
                }
                template
                    .render_with(&msgs, tools.as_ref(), false)
                    .map(|full| (full, (msgs, tools)))
                    .map_err(|e| bad(row, format!("chat template: {e}"), None))
            })
            .collect();
        let ok: Vec<&str> = rendered.iter().filter_map(|r| r.as_ref().ok().map(|(t, _)| t.as_str())).collect();
        let enc = self
            .tokenizer
            .encode_batch(ok, false)
            .map_err(|e| DataError::Tokenizer { context: "encoding rows".into(), source: e })?;
        let mut enc = enc.into_iter();
        Ok(rows
            .iter()
            .zip(rendered)
            .map(|(row, r)| {
                r.and_then(|(full, (msgs, tools))| {
                    let e = enc.next().expect("one encoding per valid row");
                    let ids = e.get_ids().to_vec();
                    // Only turns that start inside the kept tokens need locating; a row too
                    // long without `truncate` is rejected by `finish` anyway.
                    let limit = match e.get_offsets().get(self.max_seq_len) {
                        Some(&(start, _)) if self.truncate => start,
                        Some(_) => 0,
                        None => full.len(),
                    };
                    let spans = template
                        .spans_before(&msgs, tools.as_ref(), &full, limit)
                        .map_err(|e| bad(row, format!("chat template: {e}"), None))?;
                    let mask: Vec<u8> = e
                        .get_offsets()
                        .iter()
                        .map(|&(start, end)| {
                            u8::from(end > start && spans.iter().any(|&(a, b)| start >= a && start < b))
                        })
                        .collect();
                    let prompt = mask.iter().filter(|m| **m == 0).count();
                    self.finish(row, ids, mask, prompt)
                })
            })
            .collect())
    }

    fn encode_text(&self, rows: &[Row]) -> Result<Vec<Result<Encoded, DataError>>, DataError> {
        let texts: Vec<Result<&str, DataError>> =
            rows.iter().map(|r| self.field(r, "text", true).map(|t| t.unwrap_or_default())).collect();
        let ok: Vec<&str> = texts.iter().filter_map(|t| t.as_ref().ok().copied()).collect();
        let mut enc = self.batch(ok, true)?.into_iter();
        Ok(rows
            .iter()
            .zip(texts)
            .map(|(row, t)| {
                t.and_then(|_| {
                    let ids = enc.next().expect("one encoding per valid row");
                    let mask = vec![1u8; ids.len()];
                    self.finish(row, ids, mask, 0)
                })
            })
            .collect())
    }

    fn batch(&self, texts: Vec<&str>, special: bool) -> Result<Vec<Vec<u32>>, DataError> {
        let enc = self
            .tokenizer
            .encode_batch(texts, special)
            .map_err(|e| DataError::Tokenizer { context: "encoding rows".into(), source: e })?;
        Ok(enc.into_iter().map(|e| e.get_ids().to_vec()).collect())
    }

    fn finish(&self, row: &Row, mut ids: Vec<u32>, mut mask: Vec<u8>, prompt_len: usize) -> Result<Encoded, DataError> {
        let mut truncated = false;
        if ids.len() > self.max_seq_len {
            if !self.truncate {
                return Err(DataError::bad_row(
                    &row.file,
                    row.line,
                    "",
                    None,
                    format!("row has {} tokens, more than `max_seq_len` = {}", ids.len(), self.max_seq_len),
                    Some("raise `dataset.max_seq_len`, or set `dataset.truncate = true`".into()),
                ));
            }
            ids.truncate(self.max_seq_len);
            mask.truncate(self.max_seq_len);
            truncated = true;
        }
        // Position 0 is never predicted; a row needs a target after it.
        let response = mask.iter().skip(1).filter(|m| **m == 1).count();
        if response == 0 {
            return Err(DataError::bad_row(
                &row.file,
                row.line,
                "",
                None,
                "row has no tokens to learn from within `max_seq_len`".into(),
                Some("the prompt fills the whole sequence; raise `dataset.max_seq_len`".into()),
            ));
        }
        let prompt_tokens = prompt_len.min(ids.len());
        Ok(Encoded { response_tokens: ids.len() - prompt_tokens, prompt_tokens, ids, mask, truncated })
    }
}

#[cfg(test)]
mod tests {
    use super::alpaca_prompt;
    use crate::data::chat::{ALPACA, ChatTemplate};

    #[test]
    fn the_alpaca_template_renders_what_alpaca_rows_train_on() {
        let t = ChatTemplate::new(ALPACA, "<s>", "</s>").unwrap();
        let conv = |v: serde_json::Value| -> Vec<serde_json::Value> { serde_json::from_value(v).unwrap() };
        let plain = conv(
            serde_json::json!([{"role": "user", "content": "Add 2 and 3."}, {"role": "assistant", "content": "5"}]),
        );
        let want = format!("<s>{}5</s>", alpaca_prompt("Add 2 and 3.", ""));
        assert_eq!(t.render(&plain, false).unwrap(), want);
        let with_input = conv(
            serde_json::json!([{"role": "system", "content": "2, 3"}, {"role": "user", "content": "Add."}, {"role": "assistant", "content": "5"}]),
        );
        let want = format!("<s>{}5</s>", alpaca_prompt("Add.", "2, 3"));
        assert_eq!(t.render(&with_input, false).unwrap(), want);
        // The generation prompt is the prompt itself: rendering stops after `### Response:\n`.
        let (full, spans) = t.spans(&plain).unwrap();
        assert_eq!(&full[spans[0].0..spans[0].1], "5</s>");
        // For tokenizers that add no BOS, the template writes none either.
        let bare = ChatTemplate::new(crate::data::chat::alpaca_template(false), "<s>", "</s>").unwrap();
        assert_eq!(bare.render(&plain, false).unwrap(), format!("{}5</s>", alpaca_prompt("Add 2 and 3.", "")));
    }
}

#[cfg(test)]
mod conversation_tests {
    use std::collections::BTreeMap;

    use serde_json::json;

    use super::conversation;
    use crate::data::Row;

    fn row(v: serde_json::Value) -> Row {
        Row { fields: v.as_object().unwrap().clone(), file: "d.jsonl".into(), line: 1 }
    }

    /// ShareGPT rows (`conversations` of `{from, value}`) read as `messages` do, with the
    /// speakers named as Unsloth's `standardize_sharegpt` names them.
    #[test]
    fn sharegpt_conversations_are_messages() {
        let none = BTreeMap::new();
        let share = row(json!({ "conversations": [
            { "from": "system", "value": "Be brief." },
            { "from": "human", "value": "2+3?" },
            { "from": "gpt", "value": "5" },
        ]}));
        assert_eq!(
            conversation(&share, &none).unwrap(),
            vec![
                json!({ "role": "system", "content": "Be brief." }),
                json!({ "role": "user", "content": "2+3?" }),
                json!({ "role": "assistant", "content": "5" }),
            ]
        );
        // `messages` wins over `conversations`; a mapped column is the only one looked at.
        let both = row(json!({ "messages": [{ "role": "user", "content": "a" }], "conversations": [] }));
        assert_eq!(conversation(&both, &none).unwrap()[0]["content"], "a");
        let map = BTreeMap::from([("messages".to_string(), "dialog".to_string())]);
        let (msg, _) = conversation(&share, &map).unwrap_err();
        assert_eq!(msg, "row has no `dialog` column");
        let (msg, _) = conversation(&row(json!({ "text": "x" })), &none).unwrap_err();
        assert!(msg.contains("nor ShareGPT's `conversations`"), "{msg}");
        let (msg, _) = conversation(&row(json!({ "conversations": [{ "from": "human" }] })), &none).unwrap_err();
        assert!(msg.starts_with("message 0 of `conversations`"), "{msg}");
    }
}
