//! `rtune chat`: greedy replies equal transformers' `generate` (tests/fixtures/chat, made by
//! make_chat.py) on every CPU engine, multi-turn and with a system prompt; seeded sampling
//! repeats; piped turns and `/reset`; and the errors of a model not built yet.

mod common;

use common::*;

fn fixture() -> std::path::PathBuf {
    root().join("tests/fixtures/chat")
}

/// One JSON object per turn of `rtune chat <args> --format json`.
fn chat_json(args: &[&str], env: &[(&str, &str)]) -> Vec<serde_json::Value> {
    let cache = tempfile::tempdir().unwrap();
    let mut all = vec!["chat"];
    all.extend(args);
    all.extend(["--format", "json"]);
    let o = rtune_with(&root(), cache.path(), &all, env);
    assert!(o.status.success(), "{}", stderr(&o));
    stdout(&o).lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

#[test]
fn greedy_replies_equal_transformers_generate_on_every_cpu_engine() {
    let expected = read_json(&fixture().join("expected.json"));
    let model = fixture().join("tiny-alpaca");
    let model = model.to_str().unwrap();
    // The fused engine recomputes the sequence; candle's keeps keys and values between tokens.
    for engine in ["fused", "candle"] {
        for conv in expected["conversations"].as_array().unwrap() {
            let max = conv["max_new_tokens"].to_string();
            let mut args = vec![model, "--max-new-tokens", &max];
            if let Some(s) = conv["system"].as_str() {
                args.extend(["--system", s]);
            }
            let replies = conv["replies"].as_array().unwrap();
            for r in replies {
                args.extend(["--prompt", r["prompt"].as_str().unwrap()]);
            }
            let got = chat_json(&args, &[("RTUNE_ENGINE", engine)]);
            assert_eq!(got.len(), replies.len());
            for (g, want) in got.iter().zip(replies) {
                assert_eq!(g["prompt_tokens"], want["prompt_tokens"], "{engine}: {g}");
                assert_eq!(g["tokens"], want["tokens"], "{engine}: {g} vs transformers {want}");
                assert_eq!(g["reply"], want["reply"], "{engine}");
                let full =
                    want["tokens"].as_array().unwrap().len() == conv["max_new_tokens"].as_u64().unwrap() as usize;
                assert_eq!(g["stop"], if full { "max_new_tokens" } else { "stop_token" }, "{engine}: {g}");
            }
        }
    }
}

#[test]
fn seeded_sampling_repeats_and_piped_turns_reset() {
    let model = fixture().join("tiny-alpaca");
    let model = model.to_str().unwrap();
    let sample = |seed: &str| {
        let args = [model, "--temperature", "1.5", "--top-p", "0.95", "--seed", seed, "--prompt", "Name a colour."];
        chat_json(&args, &[])[0]["tokens"].clone()
    };
    assert_eq!(sample("1"), sample("1"));
    assert_ne!(sample("1"), sample("2"));
    // Piped stdin: one turn per line; `/reset` forgets the turns, so the third reply is the first.
    let cache = tempfile::tempdir().unwrap();
    let mut child = rtune_cmd()
        .args(["chat", model, "--max-new-tokens", "8"])
        .env("RTUNE_CACHE_DIR", cache.path())
        .env("RTUNE_NO_PROGRESS", "1")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write;
    child.stdin.take().unwrap().write_all(b"Name a colour.\nName another one.\n/reset\nName a colour.\n").unwrap();
    let o = child.wait_with_output().unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let lines: Vec<String> = stdout(&o).lines().map(str::to_string).collect();
    assert_eq!(lines.len(), 3, "{lines:?}");
    assert_eq!(lines[0], lines[2]);
    assert_ne!(lines[0], lines[1]);
    assert!(stderr(&o).contains("conversation reset"), "{}", stderr(&o));
}

#[test]
fn a_recipe_not_run_yet_and_bad_settings_are_clear_errors() {
    let p = Project::tiny_offline();
    let o = p.run(&["chat", "tiny.toml", "--prompt", "Hi"]);
    assert_eq!(o.status.code(), Some(1));
    let e = stderr(&o);
    assert!(e.contains("is not built yet") && e.contains("run `rtune run tiny.toml` first"), "{e}");
    let o = p.run(&["chat", "tiny.toml", "--stage", "evaluate", "--prompt", "Hi"]);
    assert!(stderr(&o).contains("stage `evaluate` is not a train stage"), "{}", stderr(&o));
    let model = fixture().join("tiny-alpaca");
    let o = p.run(&["chat", model.to_str().unwrap(), "--top-p", "0", "--prompt", "Hi"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("`--top-p` must be above 0"), "{}", stderr(&o));
    // A GGUF file is said to be one, with what serves it.
    let gguf = p.path().join("model.gguf");
    std::fs::write(&gguf, b"GGUF\x03\x00\x00\x00").unwrap();
    let o = p.run(&["chat", gguf.to_str().unwrap(), "--prompt", "Hi"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("is a GGUF file") && stderr(&o).contains("Modelfile"), "{}", stderr(&o));
}

/// A reply reaches the terminal piece by piece as tokens are chosen, not at the end: the pieces
/// the library streams join to the reply, and there are as many as whole characters allow.
#[test]
fn replies_stream_piece_by_piece() {
    let model = rtune::chat::from_folder(&fixture().join("tiny-alpaca"), rtune::plan::key::DeviceKey::cpu()).unwrap();
    let mut chat = rtune::chat::Chat::open(&model, None).unwrap();
    let s = rtune::generate::Sampling { max_new_tokens: 24, ..Default::default() };
    let mut pieces = Vec::new();
    let mut rng = rtune::rng::Rng::new(0);
    let reply =
        chat.reply("Give three tips for staying healthy.", &s, &mut rng, |p| pieces.push(p.to_string())).unwrap();
    assert!(pieces.len() > 3, "{pieces:?}");
    assert_eq!(pieces.concat(), reply.text);
}
