//! Chat templates: the model's Jinja `chat_template` rendered with minijinja the way
//! transformers' `apply_chat_template` does (`trim_blocks`, `lstrip_blocks`, loop controls,
//! Python string methods, `raise_exception`), and the assistant spans found by rendering each
//! prefix of the conversation.

use std::path::Path;

use minijinja::{Environment, ErrorKind, Value as J, context};
use serde_json::Value;

use super::DataError;

/// ChatML, for models without a template of their own (e.g. scratch models).
pub const CHATML: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

/// Date returned by `strftime_now`, fixed so that tokenization stays reproducible (Llama 3's
/// templates put "Today Date" into the system prompt; this is their own default date).
pub const FIXED_DATE: &str = "26 Jul 2024";

/// Steps one rendering may take (minijinja fuel). Real templates take a few thousand per turn;
/// a 4000-turn conversation through Llama 3's needs under a million.
const FUEL: u64 = 50_000_000;

/// Bytes one rendering may produce: far beyond any sequence rtune trains on.
const MAX_OUTPUT: usize = 64 << 20;

/// A writer that fails past [`MAX_OUTPUT`] bytes.
struct Capped(Vec<u8>);

impl std::io::Write for Capped {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.0.len() + buf.len() > MAX_OUTPUT {
            return Err(std::io::Error::other("output cap"));
        }
        self.0.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
    /// More variables (`dataset.chat_template_kwargs`), as `apply_chat_template(**kwargs)`.
    kwargs: J,
}

impl ChatTemplate {
    /// The BOS token's text the template renders `bos_token` as.
    pub fn bos_token(&self) -> &str {
        &self.bos_token
    }

    /// The EOS token's text the template renders `eos_token` as.
    pub fn eos_token(&self) -> &str {
        &self.eos_token
    }

    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<ChatTemplate, DataError> {
        let mut env = Environment::new();
        env.set_syntax(
            minijinja::syntax::SyntaxConfig::builder()
                .trim_blocks(true)
                .lstrip_blocks(true)
                .build()
                .expect("default delimiters"),
        );
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        // transformers' `tojson` is Python's json.dumps (minijinja's escapes for HTML).
        env.add_filter("tojson", super::pyjson::filter);
        // A template is code from a model folder: bounded in work and in output.
        env.set_fuel(Some(FUEL));
        env.add_function("raise_exception", |msg: String| -> Result<String, minijinja::Error> {
            Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
        });
        env.add_function("strftime_now", |fmt: String| -> String {
            match fmt.as_str() {
                "%Y-%m-%d" => "2024-07-26".into(),
                _ => FIXED_DATE.into(),
            }
        });
        env.add_template_owned("chat", source.to_string()).map_err(|e| DataError::Invalid {
            message: format!("the chat template does not parse: {e}"),
            help: Some("fix `chat_template` in tokenizer_config.json, or set `dataset.chat_template`".into()),
        })?;
        Ok(ChatTemplate {
            env,
            bos_token: bos_token.into(),
            eos_token: eos_token.into(),
            kwargs: J::from(std::collections::BTreeMap::<String, J>::new()),
        })
    }

    /// Pass more variables to every rendering (`dataset.chat_template_kwargs`); those named in
    /// [`crate::recipe::RESERVED_TEMPLATE_VARIABLES`] are the rendering's own and win.
    pub fn with_kwargs(mut self, kwargs: &std::collections::BTreeMap<String, Value>) -> ChatTemplate {
        self.kwargs = J::from(minijinja::value::Serde(kwargs));
        self
    }

    /// The template for a model folder: `dataset.chat_template` (`"chatml"` or a Jinja
    /// string) wins; else the folder's own ([`model_template`]).
    pub fn for_model(folder: &crate::model::ModelFolder, over: Option<&str>) -> Result<ChatTemplate, DataError> {
        let (source, _) = chat_source(folder, over).ok_or_else(|| DataError::Invalid {
            message: "the model has no chat template (no `chat_template.jinja`, `chat_template.json` or `chat_template` in tokenizer_config.json)".into(),
            help: Some("set `[dataset] chat_template = \"chatml\"` (or a Jinja template string)".into()),
        })?;
        let (bos, eos) = special_tokens(&folder.dir);
        ChatTemplate::new(&source, &bos, &eos)
    }

    pub fn render(&self, messages: &[Value], add_generation_prompt: bool) -> Result<String, String> {
        self.render_with(messages, None, add_generation_prompt)
    }

    /// Render `messages` with `tools` (a list of tool schemas) as transformers does: `tools`
    /// and `documents` are always variables, none when absent.
    pub fn render_with(
        &self,
        messages: &[Value],
        tools: Option<&Value>,
        add_generation_prompt: bool,
    ) -> Result<String, String> {
        let t = self.env.get_template("chat").map_err(|e| e.to_string())?;
        let mut out = Capped(Vec::new());
        t.render_captured_to(
            context! {
                messages => J::from(minijinja::value::Serde(messages)),
                tools => tools.map(|t| J::from(minijinja::value::Serde(t))),
                documents => J::from(()),
                add_generation_prompt => add_generation_prompt,
                bos_token => self.bos_token.as_str(),
                eos_token => self.eos_token.as_str(),
                ..self.kwargs.clone()
            },
            &mut out,
        )
        .map_err(|e| match e.kind() {
            ErrorKind::OutOfFuel => {
                format!("the chat template did not finish within its budget of {FUEL} steps (a runaway loop?)")
            }
            ErrorKind::WriteFailure => {
                format!("the chat template's output passed {} MiB (a runaway repetition?)", MAX_OUTPUT >> 20)
            }
            _ => match e.detail() {
                Some(d) => format!("{}: {d}", e.kind()),
                None => e.to_string(),
            },
        })?;
        String::from_utf8(out.0).map_err(|_| "the chat template rendered invalid UTF-8".to_string())
    }

    /// The rendered conversation and the byte ranges of the assistant turns in it: turn i spans
    /// from the end of `messages[..i]` rendered with a generation prompt to the end of
    /// `messages[..=i]` rendered without one.
    pub fn spans(&self, messages: &[Value]) -> Result<(String, Vec<(usize, usize)>), String> {
        let full = self.render(messages, false)?;
        let spans = self.spans_before(messages, None, &full, full.len())?;
        Ok((full, spans))
    }

    /// The assistant spans of `full` (this conversation, rendered) that start before byte
    /// `limit`: rows are truncated to `max_seq_len` tokens, so turns past the cut need no
    /// prefix renders (each costs time linear in the turns before it).
    ///
    /// A turn starts where `messages[..i]` rendered with a generation prompt ends, which must be
    /// a prefix of `full`. It ends where `messages[..=i]` rendered ends, when that is a prefix of
    /// `full` too. Templates that render a reply differently once it is no longer the last
    /// (Qwen3's gives only the last reply an empty `<think>` block) fail that; for them the turn
    /// ends after its content, found verbatim in `full`, and the closing text the template puts
    /// after it (`<|im_end|>\n`).
    pub fn spans_before(
        &self,
        messages: &[Value],
        tools: Option<&Value>,
        full: &str,
        limit: usize,
    ) -> Result<Vec<(usize, usize)>, String> {
        let mut spans = Vec::new();
        for (i, m) in messages.iter().enumerate() {
            if m["role"] != "assistant" {
                continue;
            }
            let prefix = self.render_with(&messages[..i], tools, true)?;
            if prefix.len() >= limit {
                break;
            }
            let upto = self.render_with(&messages[..=i], tools, false)?;
            let unstable = || {
                format!(
                    "the chat template renders turn {i} in a way that cannot be located in the whole conversation \
                     (it changes the turns before it, or the reply's text), so its tokens cannot be marked for the \
                     loss; train such rows with `dataset.chat_template = \"chatml\"` or split them into single \
                     exchanges"
                )
            };
            if !upto.starts_with(&prefix) || !full.starts_with(&prefix) {
                return Err(unstable());
            }
            let end = match full.starts_with(&upto) {
                true => upto.len(),
                false => {
                    reply_end(full, prefix.len(), &upto[prefix.len()..], m["content"].as_str()).ok_or_else(unstable)?
                }
            };
            if end > prefix.len() {
                spans.push((prefix.len(), end));
            }
        }
        Ok(spans)
    }
}

/// Where a reply whose turn renders on its own as `alone` (generation prompt excluded) ends in
/// `full`, searching from `start`: after its `content`, found verbatim in both, and the text
/// `alone` closes the turn with (which must not come before the content: that would be a later
/// turn's text). `None` when the content is empty or not rendered verbatim.
fn reply_end(full: &str, start: usize, alone: &str, content: Option<&str>) -> Option<usize> {
    let content = content.filter(|c| !c.is_empty())?;
    let closing = &alone[alone.rfind(content)? + content.len()..];
    let mark = Some(closing.trim()).filter(|m| !m.is_empty())?;
    let found = start + full[start..].find(content)?;
    let at = found + content.len();
    (full[at..].starts_with(closing) && !full[start..found].contains(mark)).then_some(at + closing.len())
}

/// The BOS and EOS token strings of a model folder's tokenizer_config.json (empty if unset).
pub fn special_tokens(dir: &Path) -> (String, String) {
    let cfg = read_json(&dir.join("tokenizer_config.json")).unwrap_or(Value::Null);
    let token = |k: &str| match &cfg[k] {
        Value::String(s) => s.clone(),
        Value::Object(o) => o.get("content").and_then(|c| c.as_str()).unwrap_or_default().to_string(),
        _ => String::new(),
    };
    (token("bos_token"), token("eos_token"))
}

fn read_json(path: &Path) -> Option<Value> {
    serde_json::from_str(&std::fs::read_to_string(path).ok()?).ok()
}

/// A model folder's own chat template and the file it came from, in transformers' order of
/// precedence: `chat_template.jinja` (transformers ≥ 4.43; the only place transformers 5
/// writes it), then `chat_template.json`, then `chat_template` in tokenizer_config.json (a
/// string, or a list of named templates of which `default` is used).
pub fn model_template(dir: &Path) -> Option<(String, &'static str)> {
    if let Ok(t) = std::fs::read_to_string(dir.join("chat_template.jinja")) {
        return Some((t, "chat_template.jinja"));
    }
    let named = |v: &Value| match v {
        Value::String(s) => Some(s.clone()),
        Value::Array(list) => {
            list.iter().find(|t| t["name"] == "default").and_then(|t| t["template"].as_str()).map(str::to_string)
        }
        _ => None,
    };
    if let Some(t) = read_json(&dir.join("chat_template.json")).and_then(|v| named(&v["chat_template"])) {
        return Some((t, "chat_template.json"));
    }
    read_json(&dir.join("tokenizer_config.json"))
        .and_then(|v| named(&v["chat_template"]))
        .map(|t| (t, "tokenizer_config.json"))
}

/// The Alpaca prompt as a chat template: a user turn is the instruction (a system turn, if
/// any, is its input), an assistant turn the response followed by EOS, as `alpaca` rows train
/// (with a leading BOS; [`alpaca_template`] leaves it out for tokenizers that add none).
pub const ALPACA: &str = "{{ bos_token }}{% set ns = namespace(input='') %}{% for message in messages %}{% if message['role'] == 'system' %}{% set ns.input = message['content'] %}{% elif message['role'] == 'user' %}{% if ns.input | trim %}{{ 'Below is an instruction that describes a task, paired with an input that provides further context. Write a response that appropriately completes the request.\\n\\n### Instruction:\\n' + message['content'] + '\\n\\n### Input:\\n' + ns.input + '\\n\\n### Response:\\n' }}{% else %}{{ 'Below is an instruction that describes a task. Write a response that appropriately completes the request.\\n\\n### Instruction:\\n' + message['content'] + '\\n\\n### Response:\\n' }}{% endif %}{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}{% endif %}{% endfor %}";

/// [`ALPACA`], with its leading `{{ bos_token }}` only where `alpaca` rows start with BOS
/// ([`crate::model::ModelFolder::row_bos`]).
pub fn alpaca_template(bos: bool) -> &'static str {
    match bos {
        true => ALPACA,
        false => ALPACA.strip_prefix("{{ bos_token }}").expect("ALPACA starts with the BOS"),
    }
}

/// The chat template a fine-tuned model ships with: the one its data was rendered with.
pub struct Shipped {
    /// The Jinja source.
    pub source: String,
    /// `source` parsed, with the folder's BOS and EOS tokens (no kwargs: what exports ship).
    pub template: ChatTemplate,
    /// Where it came from, for the model card (`dataset.chat_template`, `chat_template.jinja`, …).
    pub origin: String,
    /// The special token that ends an assistant turn (a stop token for inference), if the
    /// template ends turns with one.
    pub turn_end: Option<(String, u32)>,
}

/// The template exports carry for a model trained on `format` data from `folder`:
/// `chat` rows were rendered with `dataset.chat_template` or the folder's template, `alpaca`
/// rows with the Alpaca prompt ([`ALPACA`]); `text` rows with none, so the base model's template
/// (if any) is kept.
pub fn shipped(
    folder: &crate::model::ModelFolder,
    format: crate::recipe::DataFormat,
    over: Option<&str>,
    tokenizer: &tokenizers::Tokenizer,
) -> Result<Option<Shipped>, DataError> {
    use crate::recipe::DataFormat;
    let chosen = match format {
        DataFormat::Alpaca => {
            let bos = folder.row_bos(tokenizer).is_some();
            Some((alpaca_template(bos).to_string(), "the Alpaca prompt (dataset.format = \"alpaca\")".to_string()))
        }
        DataFormat::Chat => chat_source(folder, over),
        // `dataset.chat_template` applies to chat data only.
        DataFormat::Text => chat_source(folder, None),
    };
    let Some((source, origin)) = chosen else { return Ok(None) };
    let (bos, eos) = special_tokens(&folder.dir);
    let template = ChatTemplate::new(&source, &bos, &eos)?;
    let turn_end = turn_end(&template, tokenizer);
    Ok(Some(Shipped { source, template, origin, turn_end }))
}

/// The chat template `dataset.chat_template` (`over`) picks for a model — `"chatml"`, a Jinja
/// string, else the model's own — and where it comes from; None when there is none.
fn chat_source(folder: &crate::model::ModelFolder, over: Option<&str>) -> Option<(String, String)> {
    match over {
        Some("chatml") => Some((CHATML.to_string(), "dataset.chat_template = \"chatml\"".to_string())),
        Some(t) => Some((t.to_string(), "dataset.chat_template".to_string())),
        None => model_template(&folder.dir).map(|(t, file)| (t, format!("the base model's {file}"))),
    }
}

/// The special token right after an assistant turn's content: render a two-turn conversation,
/// take what its assistant span adds after the reply text, and find the first special token in
/// it (`<|im_end|>` for ChatML, `<|eot_id|>` for Llama 3, EOS for Alpaca).
pub fn turn_end(template: &ChatTemplate, tokenizer: &tokenizers::Tokenizer) -> Option<(String, u32)> {
    const REPLY: &str = "Reply.";
    let msgs: Vec<Value> = vec![
        serde_json::json!({"role": "user", "content": "Question?"}),
        serde_json::json!({"role": "assistant", "content": REPLY}),
    ];
    let (text, spans) = template.spans(&msgs).ok()?;
    let &(a, b) = spans.last()?;
    let span = &text[a..b];
    let after = &span[span.find(REPLY)? + REPLY.len()..];
    let specials: std::collections::BTreeMap<String, u32> = tokenizer
        .get_added_tokens_decoder()
        .into_iter()
        .filter(|(_, t)| t.special)
        .map(|(id, t)| (t.content, id))
        .collect();
    // The earliest special token that starts the text after the reply (whitespace aside).
    let after = after.trim_start();
    specials
        .iter()
        .filter(|(s, _)| !s.is_empty() && after.starts_with(s.as_str()))
        .map(|(s, id)| (s.clone(), *id))
        .next()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chatml_spans_cover_assistant_turns_with_their_end_marker() {
        let t = ChatTemplate::new(CHATML, "", "").unwrap();
        let msgs: Vec<Value> = serde_json::from_str(
            r#"[{"role":"system","content":"Be brief."},{"role":"user","content":"Hi"},{"role":"assistant","content":"Hello!"},{"role":"user","content":"Bye"},{"role":"assistant","content":"Bye."}]"#,
        )
        .unwrap();
        let (full, spans) = t.spans(&msgs).unwrap();
        let got: Vec<&str> = spans.iter().map(|&(a, b)| &full[a..b]).collect();
        assert_eq!(got, ["Hello!<|im_end|>\n", "Bye.<|im_end|>\n"]);
        assert!(full.starts_with("<|im_start|>system\nBe brief.<|im_end|>\n"));
    }

    /// A template that, like Qwen3's, gives only the last reply an empty think block: every
    /// reply is located in the whole conversation (the last with its block, the earlier ones as
    /// the template renders them there); one whose text the template changes is refused.
    #[test]
    fn templates_that_change_earlier_turns_locate_each_reply() {
        let src = "{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' }}{% if m.role == 'assistant' and loop.last %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}{{ m.content.split('</think>')[-1] + '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";
        let t = ChatTemplate::new(src, "", "").unwrap();
        let spans_of = |json: &str| -> Result<Vec<String>, String> {
            let msgs: Vec<Value> = serde_json::from_str(json).unwrap();
            let (full, spans) = t.spans(&msgs)?;
            Ok(spans.iter().map(|&(a, b)| full[a..b].to_string()).collect())
        };
        let one = r#"[{"role":"user","content":"Hi"},{"role":"assistant","content":"Hello!"}]"#;
        assert_eq!(spans_of(one).unwrap(), ["<think>\n\n</think>\n\nHello!<|im_end|>\n"]);
        let three = r#"[{"role":"user","content":"Hi"},{"role":"assistant","content":"Hello!"},{"role":"user","content":"Hello!"},{"role":"assistant","content":"Hello!"},{"role":"user","content":"Bye"},{"role":"assistant","content":"Bye."}]"#;
        assert_eq!(
            spans_of(three).unwrap(),
            ["Hello!<|im_end|>\n", "Hello!<|im_end|>\n", "<think>\n\n</think>\n\nBye.<|im_end|>\n"]
        );
        // The template drops reasoning from earlier replies: their text is not in the whole.
        let changed = r#"[{"role":"user","content":"Hi"},{"role":"assistant","content":"<think>hm</think>Hello!"},{"role":"user","content":"Bye"},{"role":"assistant","content":"Bye."}]"#;
        let err = spans_of(changed).unwrap_err();
        assert!(err.contains("turn 1") && err.contains("chat_template = \"chatml\""), "{err}");
    }

    #[test]
    fn template_helpers_behave_like_transformers() {
        let src = "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}{{ m['content'].strip() | upper }}{% elif m['role'] == 'assistant' %}{{ m.content }}{{ eos_token }}{% else %}{{ raise_exception('bad role ' + m['role']) }}{% endif %}{% endfor %}{{ strftime_now('%d %b %Y') }}";
        let t = ChatTemplate::new(src, "<s>", "</s>").unwrap();
        let ok: Vec<Value> =
            serde_json::from_str(r#"[{"role":"user","content":"  hi "},{"role":"assistant","content":"yo"}]"#).unwrap();
        assert_eq!(t.render(&ok, false).unwrap(), "<s>HIyo</s>26 Jul 2024");
        let bad: Vec<Value> = serde_json::from_str(r#"[{"role":"tool","content":"x"}]"#).unwrap();
        assert!(t.render(&bad, false).unwrap_err().contains("bad role tool"));
        assert!(ChatTemplate::new("{% for %}", "", "").is_err());
    }

    #[test]
    fn turn_end_is_the_special_token_after_the_reply() {
        let mut tok = tokenizers::Tokenizer::new(tokenizers::models::bpe::BPE::default());
        tok.add_special_tokens([
            tokenizers::AddedToken::from("</s>", true),
            tokenizers::AddedToken::from("<|im_end|>", true),
        ])
        .unwrap();
        let chatml = ChatTemplate::new(CHATML, "<s>", "</s>").unwrap();
        assert_eq!(turn_end(&chatml, &tok).map(|t| t.0), Some("<|im_end|>".to_string()));
        let alpaca = ChatTemplate::new(ALPACA, "<s>", "</s>").unwrap();
        assert_eq!(turn_end(&alpaca, &tok).map(|t| t.0), Some("</s>".to_string()));
        let plain = ChatTemplate::new("{% for m in messages %}{{ m['content'] }}\n{% endfor %}", "", "").unwrap();
        assert_eq!(turn_end(&plain, &tok), None);
    }

    /// `dataset.chat_template_kwargs` reach the template as transformers' `**kwargs` do
    /// (Qwen3's `enable_thinking`), and never replace the rendering's own variables.
    #[test]
    fn template_kwargs_are_variables_of_every_rendering() {
        let src = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}\
                   {% if add_generation_prompt %}<a>{% if enable_thinking is defined and not enable_thinking %}\
                   <think></think>{% endif %}{% endif %}";
        let msgs = vec![serde_json::json!({ "role": "user", "content": "hi" })];
        let plain = ChatTemplate::new(src, "<s>", "</s>").unwrap();
        assert_eq!(plain.render(&msgs, true).unwrap(), "<s>hi<a>");
        let kwargs: std::collections::BTreeMap<String, Value> = serde_json::from_value(
            serde_json::json!({ "enable_thinking": false, "bos_token": "X", "add_generation_prompt": false }),
        )
        .unwrap();
        let t = ChatTemplate::new(src, "<s>", "</s>").unwrap().with_kwargs(&kwargs);
        assert_eq!(t.render(&msgs, true).unwrap(), "<s>hi<a><think></think>");
        assert_eq!(t.render(&msgs, false).unwrap(), "<s>hi");

        // Qwen3's non-thinking mode: the generation prompt holds the empty think block, so a
        // one-exchange reply trains without it; earlier replies of a longer conversation render
        // without the block, which such a prompt cannot be located in.
        let qwen3 = "{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' }}{% if m.role == 'assistant' and loop.last %}\
                     {{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}{{ m.content + '<|im_end|>\\n' }}{% endfor %}\
                     {% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% if enable_thinking is defined and \
                     enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}{% endif %}";
        let off: std::collections::BTreeMap<String, Value> =
            serde_json::from_value(serde_json::json!({ "enable_thinking": false })).unwrap();
        let t = ChatTemplate::new(qwen3, "", "").unwrap().with_kwargs(&off);
        let one: Vec<Value> =
            serde_json::from_str(r#"[{"role":"user","content":"Hi"},{"role":"assistant","content":"Hello!"}]"#)
                .unwrap();
        let (full, spans) = t.spans(&one).unwrap();
        assert_eq!(spans.iter().map(|&(a, b)| &full[a..b]).collect::<Vec<_>>(), ["Hello!<|im_end|>\n"]);
        let two: Vec<Value> = serde_json::from_str(
            r#"[{"role":"user","content":"Hi"},{"role":"assistant","content":"Hello!"},{"role":"user","content":"Bye"},{"role":"assistant","content":"Bye."}]"#,
        )
        .unwrap();
        assert!(t.spans(&two).unwrap_err().contains("turn 1"));
    }

    #[test]
    fn runaway_templates_stop_with_a_clear_error() {
        let msgs: Vec<Value> = vec![serde_json::json!({"role": "user", "content": "x"})];
        let hang = "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}";
        let err = ChatTemplate::new(hang, "", "").unwrap().render(&msgs, false).unwrap_err();
        assert!(err.contains("budget"), "{err}");
        let big = "{% for a in range(100) %}{{ 'x' * 50000000 }}{% endfor %}";
        let err = ChatTemplate::new(big, "", "").unwrap().render(&msgs, false).unwrap_err();
        assert!(err.contains("MiB"), "{err}");
    }
}
