//! Chat templates: the model's Jinja `chat_template` rendered with minijinja the way
//! transformers' `apply_chat_template` does (`trim_blocks`, `lstrip_blocks`, loop controls,
//! Python string methods, `raise_exception`), and the assistant spans found by rendering each
//! prefix of the conversation.

use minijinja::{Environment, ErrorKind, Value as J, context};
use serde_json::Value;

use super::DataError;

/// ChatML, for models without a template of their own (e.g. scratch models).
pub const CHATML: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

/// Date returned by `strftime_now`, fixed so that tokenization stays reproducible (Llama 3's
/// templates put "Today Date" into the system prompt; this is their own default date).
pub const FIXED_DATE: &str = "26 Jul 2024";

pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
}

impl ChatTemplate {
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
        Ok(ChatTemplate { env, bos_token: bos_token.into(), eos_token: eos_token.into() })
    }

    /// The template for a model folder: `dataset.chat_template` (`"chatml"` or a Jinja
    /// string) wins; else `chat_template.jinja`, else `chat_template` in tokenizer_config.json.
    pub fn for_model(folder: &crate::model::ModelFolder, over: Option<&str>) -> Result<ChatTemplate, DataError> {
        let cfg = folder.tokenizer_config().unwrap_or(Value::Null);
        let token = |k: &str| match &cfg[k] {
            Value::String(s) => s.clone(),
            Value::Object(o) => o.get("content").and_then(|c| c.as_str()).unwrap_or_default().to_string(),
            _ => String::new(),
        };
        let source = match over {
            Some("chatml") => CHATML.to_string(),
            Some(t) => t.to_string(),
            None => std::fs::read_to_string(folder.dir.join("chat_template.jinja"))
                .ok()
                .or_else(|| match &cfg["chat_template"] {
                    Value::String(s) => Some(s.clone()),
                    // A list of named templates: the default one.
                    Value::Array(list) => list
                        .iter()
                        .find(|t| t["name"] == "default")
                        .and_then(|t| t["template"].as_str())
                        .map(str::to_string),
                    _ => None,
                })
                .ok_or_else(|| DataError::Invalid {
                    message: "the model has no chat template (no `chat_template` in tokenizer_config.json)".into(),
                    help: Some("set `[dataset] chat_template = \"chatml\"` (or a Jinja template string)".into()),
                })?,
        };
        ChatTemplate::new(&source, &token("bos_token"), &token("eos_token"))
    }

    pub fn render(&self, messages: &[Value], add_generation_prompt: bool) -> Result<String, String> {
        let t = self.env.get_template("chat").map_err(|e| e.to_string())?;
        t.render(context! {
            messages => J::from(minijinja::value::Serde(messages)),
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token.as_str(),
            eos_token => self.eos_token.as_str(),
        })
        .map_err(|e| match e.detail() {
            Some(d) => format!("{}: {d}", e.kind()),
            None => e.to_string(),
        })
    }

    /// The rendered conversation and the byte ranges of the assistant turns in it: turn i spans
    /// from the end of `messages[..i]` rendered with a generation prompt to the end of
    /// `messages[..=i]` rendered without one.
    pub fn spans(&self, messages: &[Value]) -> Result<(String, Vec<(usize, usize)>), String> {
        let full = self.render(messages, false)?;
        let mut spans = Vec::new();
        for (i, m) in messages.iter().enumerate() {
            if m["role"] != "assistant" {
                continue;
            }
            let prefix = self.render(&messages[..i], true)?;
            let upto = self.render(&messages[..=i], false)?;
            if !upto.starts_with(&prefix) || !full.starts_with(&upto) {
                return Err(format!(
                    "the chat template does not render conversations prefix-stably (turn {i}), so assistant turns cannot be located"
                ));
            }
            if upto.len() > prefix.len() {
                spans.push((prefix.len(), upto.len()));
            }
        }
        Ok((full, spans))
    }
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
}
