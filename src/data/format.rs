//! Dataset formats: rows → token ids and loss masks.
//!
//! - `alpaca`: the Stanford Alpaca prompt (with or without `### Input:`), encoded as
//!   `[bos] + encode(prompt) + encode(output) + [eos]` without the tokenizer's special tokens,
//!   where `bos` is there only if the tokenizer puts one in front of text
//!   ([`crate::model::ModelFolder::row_bos`]);
//!   bos and prompt are masked from the loss unless `train_on_prompt`.
//! - `text`: the `text` column encoded with the tokenizer's post-processor; every token counts.
//! - `chat`: the `messages` column (a list of `{role, content}`) rendered with the model's chat
//!   template ([`super::chat`]) and encoded without added special tokens (the template writes
//!   them); only the assistant turns (with the template's end-of-turn marker) count.
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

/// A rendered conversation and its messages (whose assistant spans are found after tokenizing).
type Rendered<'r> = (String, &'r Vec<Value>);

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
        let col = self.column_map.get("messages").map(String::as_str).unwrap_or("messages");
        let bad = |row: &Row, msg: String, help: Option<String>| {
            DataError::bad_row(&row.file, row.line, &Value::Object(row.fields.clone()).to_string(), None, msg, help)
        };
        let rendered: Vec<Result<Rendered<'_>, DataError>> = rows
            .iter()
            .map(|row| {
                let msgs = match row.fields.get(col) {
                    Some(Value::Array(m)) => m,
                    None => {
                        return Err(bad(
                            row,
                            format!("row has no `{col}` column"),
                            Some("map it with `[dataset] column_map = { messages = \"…\" }`".into()),
                        ));
                    }
                    Some(other) => {
                        return Err(bad(
                            row,
                            format!("`{col}` must be a list of messages, found {}", super::source::kind(other)),
                            None,
                        ));
                    }
                };
                for (i, m) in msgs.iter().enumerate() {
                    if !m["role"].is_string() || !m["content"].is_string() {
                        return Err(bad(
                            row,
                            format!("message {i} must have string `role` and `content`"),
                            Some("messages look like {\"role\": \"user\", \"content\": \"…\"}".into()),
                        ));
                    }
                }
                if !msgs.iter().any(|m| m["role"] == "assistant") {
                    return Err(bad(row, "the conversation has no assistant message to learn from".into(), None));
                }
                template
                    .render(msgs, false)
                    .map(|full| (full, msgs))
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
                r.and_then(|(full, msgs)| {
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
                        .spans_before(msgs, &full, limit)
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
