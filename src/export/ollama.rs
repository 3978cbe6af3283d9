//! Ollama's Modelfile for a GGUF export: `FROM` the file, the chat template in Ollama's Go
//! template syntax, the stop token that ends an assistant turn, and the system prompt the
//! template puts in by default.
//!
//! Ollama does not run Jinja, so the template the model trained with is translated: rtune holds
//! one Go template per family it ships (ChatML, also with a default system prompt as SmolLM2's,
//! Llama 3, Llama 3.1/3.2, Gemma 2/3, Alpaca) and picks the first that renders the
//! same text as the Jinja template for each of a set of conversations (a system prompt and
//! several turns; several turns; one turn), rendered with Ollama's rules
//! ([`super::gotemplate`]). A template none of them reproduces is reported, and no Modelfile is
//! written: a Modelfile whose template differs from training would quietly change the model.
//!
//! What Ollama does that the comparison follows: it passes every message, system ones included,
//! as `.Messages` (merging consecutive messages of one role); it prepends the Modelfile's
//! `SYSTEM` as a system message when a conversation has none; and its tokenizer adds the BOS
//! token itself, so the Jinja text is compared without a leading BOS. What it cannot follow:
//! Jinja's `trim` of message contents (Ollama's templates have no such function), so the
//! conversations checked have contents without surrounding whitespace.

use super::gotemplate::{Template, Value};
use crate::data::chat::ChatTemplate;
use std::collections::BTreeMap;

/// A chat template translated for Ollama, checked by rendering.
#[derive(Debug, Clone, PartialEq)]
pub struct Translation {
    /// Which of rtune's Go templates reproduces it (`chatml`, `llama3`, …).
    pub family: &'static str,
    /// The Go template.
    pub template: String,
    /// The system prompt the Jinja template inserts when a conversation has none (SmolLM2's),
    /// written as the Modelfile's `SYSTEM`.
    pub system: Option<String>,
    /// Conversations rendered the same by both templates.
    pub checked: usize,
    /// The Jinja template refuses system turns (Gemma 2); Ollama folds one into the first user
    /// turn, as Gemma 3 trains.
    pub refuses_system: bool,
}

/// The families rtune translates, each a Go template; Alpaca's needs the EOS token's text.
fn families(eos: &str) -> Vec<(&'static str, String)> {
    let alpaca = format!(
        "{{{{- $input := \"\" }}}}{{{{- range .Messages }}}}{{{{- if eq .Role \"system\" }}}}{{{{ $input = .Content }}}}\
         {{{{- else if eq .Role \"user\" }}}}{{{{ if $input }}}}Below is an instruction that describes a task, paired \
         with an input that provides further context. Write a response that appropriately completes the \
         request.\n\n### Instruction:\n{{{{ .Content }}}}\n\n### Input:\n{{{{ $input }}}}\n\n### Response:\n\
         {{{{ else }}}}Below is an instruction that describes a task. Write a response that appropriately \
         completes the request.\n\n### Instruction:\n{{{{ .Content }}}}\n\n### Response:\n{{{{ end }}}}\
         {{{{- else if eq .Role \"assistant\" }}}}{{{{ .Content }}}}{eos}{{{{ end }}}}{{{{- end }}}}"
    );
    vec![
        (
            "chatml",
            "{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n{{ end }}<|im_start|>assistant\n"
                .to_string(),
        ),
        (
            "llama3",
            "{{- range .Messages }}<|start_header_id|>{{ .Role }}<|end_header_id|>\n\n{{ .Content }}<|eot_id|>\
             {{- end }}<|start_header_id|>assistant<|end_header_id|>\n\n"
                .to_string(),
        ),
        (
            // Llama 3.1 and 3.2: a system turn always, dated as their templates date it
            // (rtune renders `strftime_now` as that date too, so training saw it).
            "llama3.1",
            "{{- $system := \"\" }}{{- range .Messages }}{{- if eq .Role \"system\" }}{{ $system = .Content }}\
             {{- end }}{{- end }}<|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December \
             2023\nToday Date: 26 Jul 2024\n\n{{ $system }}<|eot_id|>{{- range .Messages }}{{- if ne .Role \
             \"system\" }}<|start_header_id|>{{ .Role }}<|end_header_id|>\n\n{{ .Content }}<|eot_id|>{{- end }}\
             {{- end }}<|start_header_id|>assistant<|end_header_id|>\n\n"
                .to_string(),
        ),
        (
            "gemma",
            "{{- $system := \"\" }}{{- range .Messages }}{{- if eq .Role \"system\" }}{{ $system = .Content }}\
             {{- else }}<start_of_turn>{{ if eq .Role \"assistant\" }}model{{ else }}{{ .Role }}{{ end }}\n\
             {{ if $system }}{{ $system }}\n\n{{ $system = \"\" }}{{ end }}{{ .Content }}<end_of_turn>\n{{ end }}\
             {{- end }}<start_of_turn>model\n"
                .to_string(),
        ),
        ("alpaca", alpaca),
    ]
}

/// The family names, for messages and docs.
pub const FAMILIES: &[&str] = &["chatml", "llama3", "llama3.1", "gemma", "alpaca"];

const SYSTEM: (&str, &str) = ("system", "You are a terse assistant.");
const TURNS: [(&str, &str); 3] =
    [("user", "What is the capital of France?"), ("assistant", "Paris."), ("user", "And the capital of Italy?")];

/// The conversations both templates must render the same: a system prompt and several turns,
/// several turns, one turn; each ending with a user turn and the prompt for the reply.
fn conversations() -> Vec<Vec<(&'static str, &'static str)>> {
    let mut with_system = vec![SYSTEM];
    with_system.extend(TURNS);
    vec![with_system, TURNS.to_vec(), TURNS[..1].to_vec()]
}

/// The data Ollama renders a template with for `messages` (`.Messages` merged by role as
/// Ollama's `collate` merges them, `.System` their system messages joined).
pub fn ollama_data(messages: &[(&str, &str)]) -> Value {
    let mut merged: Vec<(String, String)> = Vec::new();
    let mut system = Vec::new();
    for (role, content) in messages {
        if *role == "system" {
            system.push(content.to_string());
        }
        match merged.last_mut() {
            Some((r, c)) if r == role => {
                c.push_str("\n\n");
                c.push_str(content);
            }
            _ => merged.push((role.to_string(), content.to_string())),
        }
    }
    let msgs = merged
        .into_iter()
        .map(|(r, c)| Value::Map(BTreeMap::from([("Role".into(), Value::Str(r)), ("Content".into(), Value::Str(c))])))
        .collect();
    Value::Map(BTreeMap::from([
        ("Messages".into(), Value::List(msgs)),
        ("System".into(), Value::Str(system.join("\n\n"))),
        ("Response".into(), Value::Str(String::new())),
    ]))
}

fn jinja(chat: &ChatTemplate, msgs: &[(&str, &str)]) -> Result<String, String> {
    let bos = chat.bos_token();
    let values: Vec<serde_json::Value> =
        msgs.iter().map(|(r, c)| serde_json::json!({"role": r, "content": c})).collect();
    let text = chat.render(&values, true)?;
    Ok(match text.strip_prefix(bos) {
        Some(rest) if !bos.is_empty() => rest.to_string(),
        _ => text,
    })
}

/// Translate `chat` for Ollama; the error says why it cannot be.
pub fn translate(chat: &ChatTemplate) -> Result<Translation, String> {
    let convs = conversations();
    let one = &convs[2];
    let j_one = jinja(chat, one).map_err(|e| format!("the chat template cannot render one user turn: {e}"))?;
    'family: for (family, source) in families(chat.eos_token()) {
        let t = Template::parse(&source).map_err(|e| format!("rtune's `{family}` Go template: {e}"))?;
        let go = |msgs: &[(&str, &str)]| t.render(&ollama_data(msgs));
        // A system prompt the Jinja template adds by itself becomes the Modelfile's SYSTEM.
        let system = match go(one)? {
            g if g == j_one => None,
            _ => match default_system(&t, one, &j_one)? {
                Some(s) => Some(s),
                None => continue,
            },
        };
        let (mut checked, mut refuses_system) = (0, false);
        for conv in &convs {
            let has_system = conv.iter().any(|(r, _)| *r == "system");
            let expected = match jinja(chat, conv) {
                Ok(t) => t,
                Err(_) if has_system => {
                    refuses_system = true;
                    continue;
                }
                Err(e) => return Err(format!("the chat template cannot render a conversation: {e}")),
            };
            let mut msgs = conv.clone();
            if let (Some(s), false) = (&system, has_system) {
                msgs.insert(0, ("system", s.as_str()));
            }
            if go(&msgs)? != expected {
                continue 'family;
            }
            checked += 1;
        }
        return Ok(Translation { family, template: source, system, checked, refuses_system });
    }
    Err(format!(
        "none of the Ollama templates rtune writes ({}) renders this chat template's conversations as it does",
        FAMILIES.join(", ")
    ))
}

/// The system prompt `expected` (the Jinja text for `one`, without a system turn) carries where
/// the Go template puts a system message's content.
fn default_system(t: &Template, one: &[(&str, &str)], expected: &str) -> Result<Option<String>, String> {
    const MARK: &str = "\u{1}SYSTEM\u{1}";
    let mut msgs = vec![("system", MARK)];
    msgs.extend_from_slice(one);
    let marked = t.render(&ollama_data(&msgs))?;
    let Some((pre, post)) = marked.split_once(MARK) else { return Ok(None) };
    if post.contains(MARK) || expected.len() <= pre.len() + post.len() {
        return Ok(None);
    }
    Ok(expected.strip_prefix(pre).and_then(|r| r.strip_suffix(post)).map(str::to_string))
}

/// The Modelfile for `gguf_file` (a name in the Modelfile's folder), stopping at `stops`;
/// None when a text cannot be quoted in a Modelfile.
pub fn modelfile(t: &Translation, gguf_file: &str, stops: &[String]) -> Result<String, String> {
    let quoted = |what: &str, s: &str| {
        if s.contains("\"\"\"") {
            Err(format!("the {what} contains `\"\"\"`, which a Modelfile cannot quote"))
        } else {
            Ok(format!("\"\"\"{s}\"\"\""))
        }
    };
    let stem = gguf_file.strip_suffix(".gguf").unwrap_or(gguf_file);
    let mut s = format!(
        "# Ollama: `ollama create NAME -f {stem}.Modelfile` in this folder, then `ollama run NAME`.\n\
         # Written by rtune; the template is rtune's `{}` Go template, checked to render {} conversations as the \
         model's chat template does.\n\
         FROM ./{gguf_file}\nTEMPLATE {}\n",
        t.family,
        t.checked,
        quoted("template", &t.template)?
    );
    if let Some(sys) = &t.system {
        s.push_str(&format!("SYSTEM {}\n", quoted("system prompt", sys)?));
    }
    for stop in stops {
        if stop.contains('"') || stop.contains('\n') {
            return Err(format!("the stop token `{stop}` cannot be quoted in a Modelfile"));
        }
        s.push_str(&format!("PARAMETER stop \"{stop}\"\n"));
    }
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::chat::{ALPACA, CHATML};

    fn translate_src(src: &str, bos: &str, eos: &str) -> Result<Translation, String> {
        translate(&ChatTemplate::new(src, bos, eos).unwrap())
    }

    /// Every family template rendered by Go's own text/template (the fixture
    /// scripts/interop/ollama-templates.sh makes) reads as rtune renders it.
    #[test]
    fn go_renders_as_rtune_does() {
        let mut convs = conversations();
        convs.push(vec![SYSTEM, TURNS[0]]);
        let mut cases = Vec::new();
        let mut ours = Vec::new();
        for (family, src) in families("</s>") {
            let t = Template::parse(&src).unwrap();
            for conv in &convs {
                let data = ollama_data(conv);
                let Value::Map(m) = &data else { unreachable!() };
                let str_of = |v: &Value| match v {
                    Value::Str(s) => s.clone(),
                    _ => unreachable!("strings"),
                };
                let Value::List(list) = &m["Messages"] else { unreachable!() };
                let messages: Vec<serde_json::Value> = list
                    .iter()
                    .map(|v| match v {
                        Value::Map(m) => {
                            serde_json::json!({"role": str_of(&m["Role"]), "content": str_of(&m["Content"])})
                        }
                        _ => unreachable!(),
                    })
                    .collect();
                let Value::Str(system) = &m["System"] else { unreachable!() };
                cases.push(
                    serde_json::json!({"family": family, "template": src, "messages": messages, "system": system}),
                );
                ours.push(serde_json::json!({"family": family, "text": t.render(&data).unwrap()}));
            }
        }
        if let Ok(path) = std::env::var("RTUNE_OLLAMA_CASES") {
            std::fs::write(path, serde_json::to_string(&cases).unwrap()).unwrap();
        }
        let fixture = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/templates/ollama-go.json");
        let go: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(fixture).unwrap()).unwrap();
        assert_eq!(
            go,
            serde_json::Value::Array(ours),
            "Go renders rtune's Ollama templates otherwise (or they changed: re-make the fixture with \
             scripts/interop/ollama-templates.sh)"
        );
    }

    #[test]
    fn every_family_template_parses() {
        for (name, src) in families("</s>") {
            Template::parse(&src).unwrap_or_else(|e| panic!("{name}: {e}"));
        }
        assert_eq!(families("").iter().map(|f| f.0).collect::<Vec<_>>(), FAMILIES);
    }

    #[test]
    fn rtunes_own_templates_translate() {
        let t = translate_src(CHATML, "", "").unwrap();
        assert_eq!((t.family, t.system.as_deref(), t.checked), ("chatml", None, 3));
        let t = translate_src(ALPACA, "<s>", "</s>").unwrap();
        assert_eq!((t.family, t.checked), ("alpaca", 3));
        assert!(t.template.contains("{{ .Content }}</s>"));
    }

    /// The upstream templates of the families rtune ships (tests/fixtures/templates) translate,
    /// each into its family, rendering every conversation the Jinja template renders.
    #[test]
    fn upstream_templates_translate_into_their_family() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/templates/");
        let cases = [
            (
                "smollm2",
                "",
                "<|endoftext|>",
                "chatml",
                Some("You are a helpful AI assistant named SmolLM, trained by Hugging Face"),
                3,
                false,
            ),
            ("llama3", "<|begin_of_text|>", "<|eot_id|>", "llama3", None, 3, false),
            ("llama3.2", "<|begin_of_text|>", "<|eot_id|>", "llama3.1", None, 3, false),
            ("gemma2", "<bos>", "<eos>", "gemma", None, 2, true),
            ("gemma3", "<bos>", "<eos>", "gemma", None, 3, false),
            // Without `enable_thinking = false` (exports ship the template without kwargs), Qwen 3
            // renders earlier assistant turns as ChatML does.
            ("qwen3", "", "<|im_end|>", "chatml", None, 3, false),
        ];
        for (file, bos, eos, family, system, checked, refuses) in cases {
            let src = std::fs::read_to_string(format!("{dir}{file}.jinja")).unwrap();
            let t = translate_src(&src, bos, eos).unwrap_or_else(|e| panic!("{file}: {e}"));
            assert_eq!(
                (t.family, t.system.as_deref(), t.checked, t.refuses_system),
                (family, system, checked, refuses),
                "{file}"
            );
        }
    }

    #[test]
    fn a_template_no_family_reproduces_is_refused() {
        let odd = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}>";
        let e = translate_src(odd, "", "").unwrap_err();
        assert!(e.contains("none of the Ollama templates"), "{e}");
    }

    #[test]
    fn the_modelfile_names_file_template_system_and_stops() {
        let t = Translation {
            family: "chatml",
            template: "T".into(),
            system: Some("Be kind.".into()),
            checked: 3,
            refuses_system: false,
        };
        let m = modelfile(&t, "model-q8_0.gguf", &["<|im_end|>".into()]).unwrap();
        assert!(m.contains("FROM ./model-q8_0.gguf\nTEMPLATE \"\"\"T\"\"\"\nSYSTEM \"\"\"Be kind.\"\"\"\nPARAMETER stop \"<|im_end|>\"\n"), "{m}");
        let bad = Translation { template: "a\"\"\"b".into(), ..t };
        assert!(modelfile(&bad, "m.gguf", &[]).is_err());
    }
}
