//! `rtune chat`: a terminal chat with a trained model, or answers to prompts for scripts.

use std::io::{BufRead, IsTerminal};

use super::*;
use rtune::chat::{Chat, Reply};
use rtune::generate::Sampling;
use rtune::recipe::Problem;
use rtune::rng::Rng;
use rtune::ui::Ui;

fn sampling(a: &ChatArgs) -> Result<Sampling, Problem> {
    let bad = |m: &str| Err(Problem::new("rtune::chat::sampling", m.to_string()));
    if !(a.temperature >= 0.0 && a.temperature.is_finite()) {
        return bad("`--temperature` must be 0 (greedy) or more");
    }
    if a.top_p.is_some_and(|p| !(p > 0.0 && p <= 1.0)) {
        return bad("`--top-p` must be above 0 and at most 1");
    }
    if a.top_k == Some(0) {
        return bad("`--top-k` must be at least 1");
    }
    if !(a.repetition_penalty > 0.0 && a.repetition_penalty.is_finite()) {
        return bad("`--repetition-penalty` must be above 0 (1 leaves the logits be)");
    }
    if a.max_new_tokens == 0 {
        return bad("`--max-new-tokens` must be at least 1");
    }
    Ok(Sampling {
        max_new_tokens: a.max_new_tokens,
        temperature: a.temperature,
        top_k: a.top_k,
        top_p: a.top_p,
        repetition_penalty: a.repetition_penalty,
    })
}

/// Run `rtune chat` with its parsed arguments; the exit code on success.
pub fn run(g: &Global, a: ChatArgs, ui: &Ui) -> Result<u8, Error> {
    let s = sampling(&a)?;
    let dir = std::path::Path::new(&a.target);
    if dir.is_file() && a.target.to_ascii_lowercase().ends_with(".gguf") {
        return Err(Problem::new(
            "rtune::chat::gguf",
            format!("`{}` is a GGUF file, which rtune chat does not read yet", a.target),
        )
        .help(
            "chat with the recipe that made it or its merged folder, or serve the file: llama.cpp's server \
             with `--jinja`, or Ollama with the .Modelfile beside it (docs/serving.md)",
        )
        .into());
    }
    let model = if dir.is_dir() {
        if a.stage.is_some() || a.base || !a.sets.is_empty() {
            return Err(Problem::new(
                "rtune::chat",
                "`--stage`, `--base` and `--set` apply to a recipe, not a model folder",
            )
            .into());
        }
        rtune::chat::from_folder(dir, rtune::plan::key::DeviceKey::cpu())?
    } else {
        let args = RecipeArgs { recipe: a.target.clone(), sets: a.sets.clone() };
        let (loaded, store, _lock, plan) = make_plan(g, &args, &SelectArgs::default())?;
        rtune::chat::from_plan(&loaded, &plan, &store, a.stage.as_deref(), a.base)?
    };
    let mut chat = Chat::open(&model, a.system.clone())?;
    let template = chat.origin.clone().unwrap_or_else(|| "none (prompts are continued as they are)".into());
    ui.status("chat", format!("{} on {}; chat template: {template}", model.described, chat.engine()));
    let json = g.json || a.format == ChatFormat::Json;
    let mut rng = Rng::derive(a.seed, "chat");
    let mut answer = |chat: &mut Chat, prompt: &str, stream: bool| -> Result<Reply, Error> {
        let reply = chat.reply(prompt, &s, &mut rng, |piece| {
            if stream {
                ui.out(piece)
            }
        })?;
        if json {
            let line = serde_json::json!({
                "prompt": prompt,
                "reply": reply.text,
                "tokens": reply.tokens,
                "prompt_tokens": reply.prompt_tokens,
                "stop": reply.stop,
            });
            ui.out(format!("{line}\n"));
        } else {
            ui.out("\n");
        }
        Ok(reply)
    };
    if !a.prompt.is_empty() {
        for p in &a.prompt {
            answer(&mut chat, p, !json)?;
        }
        return Ok(0);
    }
    let stdin = std::io::stdin();
    let interactive = stdin.is_terminal() && !json;
    if interactive {
        ui.status("chat", "type a message; /reset starts over, /exit (or Ctrl-D) ends");
    }
    let mut lines = stdin.lock().lines();
    loop {
        if interactive {
            ui.out("> ");
        }
        let Some(line) = lines.next() else { break };
        let line = line.map_err(Error::io("cannot read stdin"))?;
        let line = line.trim();
        match line {
            "" => continue,
            "/exit" | "/quit" => break,
            "/reset" => {
                chat.reset();
                ui.status("chat", "conversation reset");
                continue;
            }
            _ => {}
        }
        answer(&mut chat, line, !json)?;
    }
    if interactive {
        ui.out("\n");
    }
    Ok(0)
}
