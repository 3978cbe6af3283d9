//! Tokenization of each format against ids and masks computed independently with the Python
//! `tokenizers` library and jinja2 (tests/fixtures/tokens/make_tokens.py, fixtures in
//! tests/fixtures/tokens).

mod common;

use std::collections::BTreeMap;
use std::path::PathBuf;

use rtune::data::chat::ChatTemplate;
use rtune::data::{Renderer, read_rows};
use rtune::recipe::DataFormat;

fn fixtures() -> PathBuf {
    common::root().join("tests/fixtures/tokens")
}

fn expected() -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(fixtures().join("expected.json")).unwrap()).unwrap()
}

/// A renderer with long sequences, truncation on and prompts masked.
fn renderer<'a>(
    tokenizer: &'a tokenizers::Tokenizer,
    format: DataFormat,
    (bos, eos): (Option<u32>, Option<u32>),
    column_map: &'a BTreeMap<String, String>,
    chat: Option<&'a ChatTemplate>,
) -> Renderer<'a> {
    Renderer {
        tokenizer,
        format,
        bos,
        eos,
        max_seq_len: 4096,
        truncate: true,
        train_on_prompt: false,
        column_map,
        chat,
    }
}

fn check(format: DataFormat, file: &str, key: &str, chat: Option<&ChatTemplate>) {
    let tokenizer = tokenizers::Tokenizer::from_file(fixtures().join("tokenizer.json")).unwrap();
    let exp = expected();
    let column_map = BTreeMap::new();
    let ids = (exp["bos"].as_u64().map(|v| v as u32), exp["eos"].as_u64().map(|v| v as u32));
    let r = renderer(&tokenizer, format, ids, &column_map, chat);
    let (rows, bad) = read_rows(&fixtures().join(file), false).unwrap();
    assert!(bad.is_empty());
    let got = r.encode(&rows).unwrap();
    let want = exp[key].as_array().unwrap();
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.into_iter().zip(want).enumerate() {
        let g = g.unwrap_or_else(|e| panic!("{key} row {i}: {e}"));
        let ids: Vec<u32> = serde_json::from_value(w["ids"].clone()).unwrap();
        let mask: Vec<u8> = serde_json::from_value(w["mask"].clone()).unwrap();
        assert_eq!(g.ids, ids, "{key} row {i}: ids");
        assert_eq!(g.mask, mask, "{key} row {i}: mask");
    }
}

#[test]
fn alpaca_matches_python_tokenizers() {
    check(DataFormat::Alpaca, "alpaca.jsonl", "alpaca", None);
}

#[test]
fn parquet_rows_equal_their_jsonl_twins() {
    for (a, b) in [("alpaca.parquet", "alpaca.jsonl"), ("chat.parquet", "chat.jsonl")] {
        let (pq, _) = read_rows(&fixtures().join(a), false).unwrap();
        let (js, _) = read_rows(&fixtures().join(b), false).unwrap();
        assert_eq!(pq.len(), js.len());
        for (p, j) in pq.iter().zip(&js) {
            assert_eq!(p.fields, j.fields, "{a}");
        }
    }
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("broken.parquet"), b"PAR1 this is not parquet PAR1").unwrap();
    let e = read_rows(&dir.path().join("broken.parquet"), false).unwrap_err();
    assert!(e.to_string().contains("`broken.parquet` is not a readable Parquet file"), "{e}");
}

#[test]
fn text_matches_python_tokenizers() {
    check(DataFormat::Text, "text.jsonl", "text", None);
}

#[test]
fn chat_matches_jinja2_and_python_tokenizers() {
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixtures().join("tokenizer_config.json")).unwrap()).unwrap();
    let t = ChatTemplate::new(cfg["chat_template"].as_str().unwrap(), "<|begin_of_text|>", "<|end_of_text|>").unwrap();
    // The rendered text is jinja2's, byte for byte.
    for (row, want) in std::fs::read_to_string(fixtures().join("chat.jsonl"))
        .unwrap()
        .lines()
        .zip(expected()["chat"].as_array().unwrap())
    {
        let v: serde_json::Value = serde_json::from_str(row).unwrap();
        assert_eq!(t.render(v["messages"].as_array().unwrap(), false).unwrap(), want["text"].as_str().unwrap());
    }
    check(DataFormat::Chat, "chat.jsonl", "chat", Some(&t));
}

#[test]
fn chat_rows_with_problems_name_the_line() {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("bad.jsonl");
    std::fs::write(
        &f,
        "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}, {\"role\": \"assistant\", \"content\": \"yo\"}]}\n\
         {\"messages\": [{\"role\": \"user\", \"content\": \"no answer\"}]}\n\
         {\"messages\": \"not a list\"}\n\
         {\"messages\": [{\"role\": \"user\", \"content\": 3}]}\n\
         {\"conversation\": []}\n",
    )
    .unwrap();
    let tokenizer = tokenizers::Tokenizer::from_file(fixtures().join("tokenizer.json")).unwrap();
    let t = ChatTemplate::new(rtune::data::chat::CHATML, "", "").unwrap();
    let column_map = BTreeMap::new();
    let r = renderer(&tokenizer, DataFormat::Chat, (None, None), &column_map, Some(&t));
    let (rows, _) = read_rows(&f, false).unwrap();
    let got = r.encode(&rows).unwrap();
    assert!(got[0].is_ok());
    let msgs: Vec<String> = got[1..].iter().map(|e| rtune::ui::render_plain(e.as_ref().unwrap_err())).collect();
    assert!(msgs[0].contains("bad.jsonl:2") && msgs[0].contains("no assistant message"), "{}", msgs[0]);
    assert!(msgs[1].contains("bad.jsonl:3") && msgs[1].contains("must be a list of messages"), "{}", msgs[1]);
    assert!(msgs[2].contains("bad.jsonl:4") && msgs[2].contains("must have a string `role`"), "{}", msgs[2]);
    assert!(msgs[3].contains("bad.jsonl:5") && msgs[3].contains("no `messages` column"), "{}", msgs[3]);
}

/// A recipe with a tiny scratch Llama, LoRA on q/v and the CPU, around `dataset` and `stages`.
fn scratch_recipe(name: &str, dataset: &str, stages: &str) -> String {
    format!(
        "[recipe]\nname = \"{name}\"\n[model]\nscratch = {{ arch = \"llama\", hidden_size = 32, num_layers = 1, num_heads = 2, \
         num_kv_heads = 1, intermediate_size = 64, vocab_size = 300 }}\n[dataset]\n{dataset}\n[adapter]\nkind = \"lora\"\n\
         rank = 4\nalpha = 8\ntargets = [\"q_proj\", \"v_proj\"]\n[device]\nprefer = [\"cpu\"]\n{stages}\n"
    )
}

#[test]
fn a_chat_recipe_tokenizes_and_trains_end_to_end() {
    let dir = tempfile::tempdir().unwrap();
    let rows: String = (0..60)
        .map(|i| {
            format!(
                "{{\"messages\": [{{\"role\": \"user\", \"content\": \"What is {i} plus one?\"}}, {{\"role\": \"assistant\", \"content\": \"It is {}.\"}}]}}\n",
                i + 1
            )
        })
        .collect();
    std::fs::write(dir.path().join("chat.jsonl"), rows).unwrap();
    std::fs::write(
        dir.path().join("chat.toml"),
        scratch_recipe(
            "chat-demo",
            "path = \"chat.jsonl\"\nformat = \"chat\"\nchat_template = \"chatml\"\nmax_seq_len = 64",
            "[stages.train]\nmax_steps = 3\nbatch_size = 8",
        ),
    )
    .unwrap();
    let o = common::rtune(dir.path(), &dir.path().join("cache"), &["run", "chat.toml", "--json"]);
    assert!(o.status.success(), "{}", common::stderr(&o));
    let report: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let tok = report["stages"].as_array().unwrap().iter().find(|s| s["name"] == "tokenize").unwrap();
    let m = &tok["metrics"];
    // Only assistant turns count: fewer response tokens than prompt tokens in these rows.
    assert!(m["response_tokens"].as_u64().unwrap() > 0, "{m}");
    assert!(m["prompt_tokens"].as_u64().unwrap() > m["response_tokens"].as_u64().unwrap(), "{m}");
}

#[test]
fn an_evaluate_stage_can_measure_its_own_dataset() {
    let dir = tempfile::tempdir().unwrap();
    let rows = std::fs::read_to_string(common::root().join("tests/fixtures/data/tiny-alpaca.jsonl")).unwrap();
    std::fs::write(dir.path().join("train.jsonl"), &rows).unwrap();
    let heldout: String = rows.lines().take(5).map(|l| format!("{l}\n")).collect();
    std::fs::write(dir.path().join("heldout.jsonl"), &heldout).unwrap();
    std::fs::write(
        dir.path().join("r.toml"),
        scratch_recipe(
            "eval-demo",
            "path = \"train.jsonl\"\nformat = \"alpaca\"\nmax_seq_len = 256",
            "[stages.train]\nmax_steps = 3\nbatch_size = 4\n[stages.eval_heldout]\nkind = \"evaluate\"\nmodel = \"both\"\ndataset = \"heldout.jsonl\"",
        ),
    )
    .unwrap();
    let run = |args: &[&str]| {
        let o = common::rtune(dir.path(), &dir.path().join("cache"), args);
        assert!(o.status.success(), "{}", common::stderr(&o));
        o
    };
    let report: serde_json::Value = serde_json::from_slice(&run(&["run", "r.toml", "--json"]).stdout).unwrap();
    let ev = report["stages"].as_array().unwrap().iter().find(|s| s["name"] == "eval_heldout").unwrap();
    let m = &ev["metrics"]["results"];
    assert!(m["base"]["eval_loss"].as_f64().unwrap() > 0.0 && m["tuned"]["eval_loss"].as_f64().unwrap() > 0.0, "{m}");
    let n = m["tuned"]["eval_tokens"].as_u64().unwrap();
    assert!(n > 0, "{m}");

    // It needs no tokenize stage, and editing its file re-runs only it.
    let plan = common::stdout(&run(&["plan", "r.toml"]));
    assert!(plan.lines().any(|l| l.starts_with("eval_heldout") && l.contains(" download,train ")), "{plan}");
    std::fs::write(dir.path().join("heldout.jsonl"), heldout.replacen('a', "b", 1)).unwrap();
    let plan = common::stdout(&run(&["plan", "r.toml"]));
    assert!(plan.contains("source changed: dataset") && plan.contains("1 to run"), "{plan}");
}

/// Issue 21: a 4000-turn conversation used to take ~32 s (every assistant turn rendered two
/// prefixes of the whole conversation). Only turns that start inside the kept `max_seq_len`
/// tokens are located now; the masks of what is kept are the same as a short conversation's.
#[test]
fn long_conversations_are_located_only_up_to_the_truncation_point() {
    let tokenizer = tokenizers::Tokenizer::from_file(fixtures().join("tokenizer.json")).unwrap();
    let column_map = BTreeMap::new();
    let template = ChatTemplate::new(rtune::data::chat::CHATML, "", "").unwrap();
    let mut r = renderer(&tokenizer, DataFormat::Chat, (None, None), &column_map, Some(&template));
    r.max_seq_len = 64;
    let turns = |n: usize| -> Vec<rtune::data::Row> {
        let msgs: Vec<serde_json::Value> = (0..n)
            .map(|i| {
                let role = if i % 2 == 0 { "user" } else { "assistant" };
                serde_json::json!({ "role": role, "content": format!("turn {i}") })
            })
            .collect();
        let fields = serde_json::Map::from_iter([("messages".to_string(), serde_json::Value::Array(msgs))]);
        vec![rtune::data::Row { fields, file: "t.jsonl".into(), line: 1 }]
    };
    let started = std::time::Instant::now();
    let long = r.encode(&turns(4000)).unwrap().remove(0).unwrap();
    assert!(started.elapsed().as_secs_f64() < 5.0, "took {:?}", started.elapsed());
    let short = r.encode(&turns(40)).unwrap().remove(0).unwrap();
    assert!(long.truncated && long.ids.len() == 64);
    assert_eq!(long.ids, short.ids[..64]);
    assert_eq!(long.mask, short.mask[..64]);
    assert!(long.mask.contains(&1));
}

/// Chat templates' `tojson` writes what transformers' does — Python's `json.dumps` with the
/// filter's keyword arguments (tests/fixtures/data/tojson.json, written by make_tojson.py):
/// tool calls' arguments and tool schemas are part of the training rows.
#[test]
fn tojson_writes_what_transformers_writes() {
    let path = common::root().join("tests/fixtures/data/tojson.json");
    let fixture: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let cases = fixture["cases"].as_array().unwrap();
    assert!(cases.len() > 100);
    for case in cases {
        let args: Vec<String> = case["kwargs"]
            .as_object()
            .unwrap()
            .iter()
            .map(|(k, v)| match v {
                serde_json::Value::Array(seps) => format!("{k}=({}, {})", seps[0], seps[1]),
                v => format!("{k}={v}"),
            })
            .collect();
        let src = format!("{{{{ messages[0].v | tojson({}) }}}}", args.join(", "));
        let t = ChatTemplate::new(&src, "", "").unwrap();
        let msgs = vec![serde_json::json!({ "role": "user", "content": "", "v": case["value"] })];
        let got = t.render(&msgs, false).unwrap_or_else(|e| panic!("{src}: {e}"));
        assert_eq!(got, case["expected"].as_str().unwrap(), "{src} of {}", case["value"]);
    }
    // A template's own dicts keep their order, as Python's do; a first positional argument is
    // `ensure_ascii`, as in transformers' filter.
    let t = ChatTemplate::new(
        r#"{{ {"name": "f", "arguments": {"z": 1, "a": [1.0, "é"]}} | tojson }}|{{ "é" | tojson(true) }}"#,
        "",
        "",
    )
    .unwrap();
    assert_eq!(t.render(&[], false).unwrap(), r#"{"name": "f", "arguments": {"z": 1, "a": [1.0, "é"]}}|"\u00e9""#);
}

/// Tool-calling rows (tests/fixtures/data/tool_chats.json, written by make_tool_chats.py with
/// transformers): messages reach the template whole (`tool_calls`, `tool_call_id`, null
/// content), the `tools` column (a list, or a JSON string) is the template's `tools`, the text
/// is transformers' `apply_chat_template(…, tools=…)`'s, and the loss covers each assistant
/// turn's tool calls, never the tool results.
#[test]
fn tool_calling_rows_render_as_transformers_renders_them() {
    let path = common::root().join("tests/fixtures/data/tool_chats.json");
    let fixture: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let t = ChatTemplate::new(fixture["template"].as_str().unwrap(), "", "").unwrap();
    let none = BTreeMap::new();
    for (i, case) in fixture["cases"].as_array().unwrap().iter().enumerate() {
        let fields = serde_json::Map::from_iter([
            ("messages".to_string(), case["messages"].clone()),
            ("tools".to_string(), case["tools"].clone()),
        ]);
        let row = rtune::data::Row { fields, file: "t.jsonl".into(), line: i + 1 };
        let msgs = rtune::data::format::conversation(&row, &none).unwrap();
        let tools = rtune::data::format::tools(&row, &none).unwrap();
        let full = t.render_with(&msgs, tools.as_ref(), false).unwrap();
        assert_eq!(full, case["rendered"].as_str().unwrap(), "case {i}");
        let with_prompt = t.render_with(&msgs[..msgs.len() - 1], tools.as_ref(), true).unwrap();
        assert_eq!(with_prompt, case["rendered_gen"].as_str().unwrap(), "case {i}");
        let spans = t.spans_before(&msgs, tools.as_ref(), &full, full.len()).unwrap();
        let trained: Vec<&str> = spans.iter().map(|&(a, b)| &full[a..b]).collect();
        let replies = msgs.iter().filter(|m| m["role"] == "assistant").count();
        assert_eq!(trained.len(), replies, "case {i}: {trained:?}");
        assert!(trained.iter().all(|s| s.ends_with("<|im_end|>\n") && !s.contains("<result")), "{trained:?}");
        if i < 2 {
            assert!(trained[0].contains("<call>{\"name\": \"get_"), "case {i}: {trained:?}");
        }
    }
    // A `tools` cell that is not a list, or a string that is not JSON, is a bad row.
    for bad in [serde_json::json!({ "name": "f" }), serde_json::json!("[{\"name\": "), serde_json::json!(3)] {
        let fields = serde_json::Map::from_iter([("tools".to_string(), bad)]);
        let row = rtune::data::Row { fields, file: "t.jsonl".into(), line: 1 };
        let (msg, _) = rtune::data::format::tools(&row, &none).unwrap_err();
        assert!(msg.starts_with("`tools`"), "{msg}");
    }
    // A column the recipe maps `tools` to must be there.
    let row = rtune::data::Row { fields: serde_json::Map::new(), file: "t.jsonl".into(), line: 1 };
    assert_eq!(rtune::data::format::tools(&row, &none).unwrap(), None);
    let map = BTreeMap::from([("tools".to_string(), "functions".to_string())]);
    assert_eq!(rtune::data::format::tools(&row, &map).unwrap_err().0, "row has no `functions` column");
}

/// tests/fixtures/data/splits.json: 🤗 datasets' own splits of folder layouts and dataset cards.
fn split_fixture() -> serde_json::Value {
    let path = common::root().join("tests/fixtures/data/splits.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// A folder's files fall into the splits 🤗 datasets gives them (tests/fixtures/data/splits.json,
/// written by make_splits.py with datasets itself: hand-picked layouts and 400 seeded random
/// ones), errors included.
#[test]
fn splits_are_inferred_from_file_names_as_datasets_does() {
    let fixture = split_fixture();
    let cases = fixture["cases"].as_array().unwrap();
    assert!(cases.len() > 400);
    for case in cases {
        let files: Vec<String> = serde_json::from_value(case["files"].clone()).unwrap();
        let got = rtune::data::splits::infer(&files);
        match case["error"].as_str() {
            Some("ValueError") => assert!(got.is_err(), "{files:?}: datasets refuses, rtune gave {got:?}"),
            Some("EmptyDatasetError") => assert_eq!(got, Ok(vec![]), "{files:?}"),
            Some(other) => panic!("unexpected error kind {other}"),
            None => {
                let want: rtune::data::splits::Splits = serde_json::from_value(case["splits"].clone()).unwrap();
                assert_eq!(got, Ok(want), "{files:?}");
            }
        }
    }
}

/// A folder of `train.jsonl` (30 rows), `validation.jsonl` (4) and `test.jsonl` (6) beside
/// `r.toml` built around `dataset`, a short train stage and `stages` (the scratch model's
/// tokenizer learns the train split).
fn split_folder(dataset: &str, stages: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let rows = std::fs::read_to_string(common::root().join("tests/fixtures/data/tiny-alpaca.jsonl")).unwrap();
    let lines: Vec<&str> = rows.lines().collect();
    std::fs::create_dir(dir.path().join("data")).unwrap();
    for (name, range) in [("train", 0..30), ("validation", 30..34), ("test", 34..40)] {
        let text: String = lines[range].iter().map(|l| format!("{l}\n")).collect();
        std::fs::write(dir.path().join(format!("data/{name}.jsonl")), text).unwrap();
    }
    let stages = format!("[stages.train]\nmax_steps = 2\nbatch_size = 4\n{stages}");
    std::fs::write(dir.path().join("r.toml"), scratch_recipe("splits", dataset, &stages)).unwrap();
    dir
}

/// The tokenize stage's metrics and stderr of `rtune run r.toml --until tokenize`.
fn tokenized(dir: &std::path::Path) -> (serde_json::Value, String) {
    let o = common::rtune(dir, &dir.join("cache"), &["run", "r.toml", "--until", "tokenize", "--json"]);
    assert!(o.status.success(), "{}", common::stderr(&o));
    let report: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let tok = report["stages"].as_array().unwrap().iter().find(|s| s["name"] == "tokenize").unwrap();
    (tok["metrics"].clone(), common::stderr(&o))
}

/// A folder's test and validation files never train (they did: every file's rows were pooled
/// and 5 % of them held out), and the run says which splits it left unread.
#[test]
fn a_dataset_folder_trains_on_its_train_split_only() {
    let dir = split_folder("path = \"data\"\nformat = \"alpaca\"\nmax_seq_len = 256", "");
    let (m, err) = tokenized(dir.path());
    assert_eq!(m["rows"], 30, "{m}");
    assert_eq!((m["train_rows"].as_u64().unwrap(), m["eval_rows"].as_u64().unwrap()), (28, 2), "{m}");
    assert_eq!(m["unread_splits"], serde_json::json!({"validation": 1, "test": 1}), "{m}");
    assert!(
        err.contains("(split `train`; not read: `validation` (1 file), `test` (1 file))"),
        "the run names the splits it did not read: {err}"
    );
}

/// `dataset.eval_split` evaluates on a split of the dataset's own, every row of it.
#[test]
fn an_eval_split_holds_the_eval_rows() {
    let dir = split_folder("path = \"data\"\nformat = \"alpaca\"\nmax_seq_len = 256\neval_split = \"test\"", "");
    let (m, err) = tokenized(dir.path());
    assert_eq!((m["rows"].as_u64(), m["train_rows"].as_u64(), m["eval_rows"].as_u64()), (Some(36), Some(30), Some(6)));
    assert_eq!(m["unread_splits"], serde_json::json!({"validation": 1}), "{m}");
    assert!(err.contains("(split `train`, eval split `test`; not read: `validation` (1 file))"), "{err}");
}

/// Splits that cannot be read are refused when the plan is made, where the recipe names them.
#[test]
fn impossible_splits_are_refused_by_the_plan() {
    let cases = [
        (
            "split = \"dev\"",
            "",
            "rtune::data::no_split",
            "no split `dev`: they name `train` (1 file), `validation` (1 file), `test` (1 file)",
            "split = \"dev\"",
        ),
        (
            "eval_split = \"test\"\neval_fraction = 0.1",
            "",
            "rtune::plan::eval_split",
            "both choose the eval rows",
            "eval_fraction = 0.1",
        ),
        (
            "eval_split = \"train\"",
            "",
            "rtune::plan::eval_split",
            "split `train` would both train and evaluate",
            "eval_split = \"train\"",
        ),
        ("eval_split = \"holdout\"", "", "rtune::data::no_split", "no split `holdout`", "eval_split = \"holdout\""),
        (
            "config = \"chat\"",
            "",
            "rtune::data::invalid",
            "the dataset has no configs (no `configs:` in its README.md)",
            "config = \"chat\"",
        ),
        (
            "",
            "[stages.e]\nkind = \"evaluate\"\nmodel = \"base\"\ndataset = \"data\"",
            "rtune::plan::which_split",
            "the files of `data` name several splits: `train` (1 file), `validation` (1 file), `test` (1 file)",
            "dataset = \"data\"",
        ),
    ];
    for (extra, stages, code, message, at) in cases {
        let dir = split_folder(&format!("path = \"data\"\nformat = \"alpaca\"\n{extra}"), stages);
        let o = common::rtune(dir.path(), &dir.path().join("cache"), &["plan", "r.toml"]);
        let err = common::stderr(&o);
        assert_eq!(o.status.code(), Some(1), "{extra} {stages}: {err}");
        // The message as one line (miette wraps it at the terminal's width).
        let flat = err.split_whitespace().filter(|w| *w != "│").collect::<Vec<_>>().join(" ");
        assert!(flat.contains(code) && flat.contains(message), "{extra} {stages}: {err}");
        assert!(err.lines().any(|l| l.contains('│') && l.contains(at)), "located at `{at}`: {err}");
    }
    // A file both splits name would train and evaluate.
    let dir = split_folder("path = \"data\"\nformat = \"alpaca\"\neval_split = \"test\"", "");
    std::fs::copy(dir.path().join("data/test.jsonl"), dir.path().join("data/train_test.jsonl")).unwrap();
    let o = common::rtune(dir.path(), &dir.path().join("cache"), &["plan", "r.toml"]);
    let err = common::stderr(&o);
    let flat = err.split_whitespace().filter(|w| *w != "│").collect::<Vec<_>>().join(" ");
    assert!(
        flat.contains("rtune::data::split_overlap")
            && flat.contains("`train_test.jsonl` is in both split `train` and split `test`"),
        "{err}"
    );
    // A single file is one split.
    let dir = split_folder("path = \"data/train.jsonl\"\nformat = \"alpaca\"\nsplit = \"train\"", "");
    let o = common::rtune(dir.path(), &dir.path().join("cache"), &["plan", "r.toml"]);
    let err = common::stderr(&o);
    assert!(err.contains("rtune::plan::split_of_file") && err.contains("is a file, which is one split"), "{err}");
}

/// An evaluate stage measures the split of its folder that it names (of the card's config it
/// names): the same rows, tokens and loss as the split's file named directly.
#[test]
fn an_evaluate_stage_reads_the_split_it_names() {
    let stages = "[stages.by_split]\nkind = \"evaluate\"\nmodel = \"base\"\ndataset = \"data\"\nsplit = \"validation\"\n\
                  [stages.by_file]\nkind = \"evaluate\"\nmodel = \"base\"\ndataset = \"data/validation.jsonl\"\n\
                  [stages.by_config]\nkind = \"evaluate\"\nmodel = \"base\"\ndataset = \"data\"\nconfig = \"swapped\"\n\
                  split = \"validation\"\n\
                  [stages.by_test_file]\nkind = \"evaluate\"\nmodel = \"base\"\ndataset = \"data/test.jsonl\"";
    let dir = split_folder("path = \"data\"\nformat = \"alpaca\"\nmax_seq_len = 256", stages);
    // The default config reads the files' own splits; `swapped` evaluates on test.jsonl.
    let card = "---\nconfigs:\n- config_name: default\n  data_files:\n  - {split: train, path: train.jsonl}\n  \
                - {split: validation, path: validation.jsonl}\n  - {split: test, path: test.jsonl}\n\
                - config_name: swapped\n  data_files:\n  - {split: validation, path: test.jsonl}\n---\n";
    std::fs::write(dir.path().join("data/README.md"), card).unwrap();
    let o = common::rtune(dir.path(), &dir.path().join("cache"), &["run", "r.toml", "--json"]);
    let err = common::stderr(&o);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("tokens of split `validation` of `data`"), "{err}");
    let report: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let metrics = |name: &str| {
        report["stages"].as_array().unwrap().iter().find(|s| s["name"] == name).unwrap()["metrics"].clone()
    };
    let (a, b) = (metrics("by_split"), metrics("by_file"));
    assert!(a["eval_tokens"].as_u64().unwrap() > 0, "{a}");
    assert_eq!((&a["eval_tokens"], &a["eval_loss"]), (&b["eval_tokens"], &b["eval_loss"]), "{a} {b}");
    let (c, d) = (metrics("by_config"), metrics("by_test_file"));
    assert_eq!((&c["eval_tokens"], &c["eval_loss"]), (&d["eval_tokens"], &d["eval_loss"]), "{c} {d}");
    assert_ne!(c["eval_tokens"], a["eval_tokens"], "{c} {a}");
}

/// A dataset card's `configs:` choose the files of each split as 🤗 datasets' `load_dataset(folder,
/// name)` does (the `configs` of tests/fixtures/data/splits.json), refusals included.
#[test]
fn dataset_card_configs_choose_files_as_datasets_does() {
    let fixture = split_fixture();
    let cases = fixture["configs"].as_array().unwrap();
    assert!(cases.len() > 15);
    for case in cases {
        let dir = tempfile::tempdir().unwrap();
        let files: Vec<String> = serde_json::from_value(case["files"].clone()).unwrap();
        for f in &files {
            let p = dir.path().join(f);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, "").unwrap();
        }
        let readme = format!("---\nconfigs:\n{}---\n# a dataset\n", case["readme"].as_str().unwrap());
        std::fs::write(dir.path().join("README.md"), readme).unwrap();
        let config = case["config"].as_str();
        let got =
            rtune::data::source::folder_splits(dir.path(), config).map(|(splits, _)| splits).map_err(|e| e.to_string());
        match case["error"].as_str() {
            Some(_) => assert!(got.is_err(), "{case}: datasets refuses, rtune gave {got:?}"),
            None => {
                let want: rtune::data::splits::Splits = serde_json::from_value(case["splits"].clone()).unwrap();
                assert_eq!(got, Ok(want), "{case}");
            }
        }
    }
}

/// Each format, and a dataset card's loader settings (`sep`, `field`, `sample_by`, …), read into
/// the rows 🤗 datasets' `load_dataset(folder, name, split="train")` gives
/// (tests/fixtures/data/formats.json, from make_formats.py): `.tsv` files, JSON Lines or
/// pretty-printed objects in a `.json` file, lists of strings, a field's rows or columns,
/// paragraphs. Values compare as text (a CSV's `1` is the string "1" in rtune, the number 1 in
/// datasets; other non-strings as compact JSON); rtune skips rows whose text is blank. Settings
/// rtune does not apply (`refused`) are errors naming them; a file datasets cannot read is an
/// error in rtune too.
#[test]
fn formats_and_card_settings_read_rows_as_datasets_does() {
    let fixture: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(common::root().join("tests/fixtures/data/formats.json")).unwrap(),
    )
    .unwrap();
    let cases = fixture["cases"].as_array().unwrap();
    assert!(cases.len() > 30);
    let plain = |v: &serde_json::Value| match v {
        serde_json::Value::String(s) => s.clone(),
        other => other.to_string(),
    };
    for case in cases {
        let dir = tempfile::tempdir().unwrap();
        for (rel, text) in case["files"].as_object().unwrap() {
            let p = dir.path().join(rel);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, text.as_str().unwrap()).unwrap();
        }
        let mut rows = Vec::new();
        let got = rtune::data::data_files(dir.path(), Some("train"), case["config"].as_str()).and_then(|files| {
            rtune::data::for_each_row(
                &files,
                false,
                &mut |r| {
                    rows.push(r.fields.iter().map(|(k, v)| (k.clone(), plain(v))).collect::<BTreeMap<_, _>>());
                    Ok(())
                },
                &mut |_| {},
            )
        });
        let name = case["name"].as_str().unwrap();
        if case["refused"].as_bool().unwrap() {
            let e = got.expect_err(name).to_string();
            assert!(e.contains("rtune does not apply") || e.contains("rtune reads"), "{name}: {e}");
            continue;
        }
        if case.get("error").is_some() {
            assert!(got.is_err(), "{name}: datasets refuses, rtune read {rows:?}");
            continue;
        }
        got.unwrap_or_else(|e| panic!("{name}: {e}"));
        let want: Vec<BTreeMap<String, String>> = serde_json::from_value(case["rows"].clone()).unwrap();
        let want: Vec<_> = want.into_iter().filter(|r| r.get("text").is_none_or(|t| !t.trim().is_empty())).collect();
        assert_eq!(rows, want, "{name}");
    }
}
