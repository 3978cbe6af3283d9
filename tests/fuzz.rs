//! Fuzz-style property tests: random bytes, random TOML and random `--set` arguments thrown at
//! the recipe loader. Whatever comes in, it returns a value or located problems — never panics.

use proptest::prelude::*;
use rtune::recipe::{Overrides, RecipeSource, builtin, load_text};

const KEYS: &[&str] = &[
    "recipe",
    "name",
    "seed",
    "model",
    "scratch",
    "path",
    "repo",
    "revision",
    "dataset",
    "format",
    "eval_fraction",
    "max_seq_len",
    "adapter",
    "rank",
    "alpha",
    "targets",
    "device",
    "prefer",
    "dtype",
    "cpu",
    "cuda:1",
    "stages",
    "train",
    "evaluate",
    "tokenize",
    "kind",
    "needs",
    "learning_rate",
    "schedule",
    "betas",
    "epochs",
    "x",
    "",
];

fn value() -> impl Strategy<Value = String> {
    let leaf = prop_oneof![
        any::<i64>().prop_map(|i| i.to_string()),
        any::<f64>().prop_map(|f| format!("{f:?}")),
        Just("nan".to_string()),
        Just("-inf".to_string()),
        "[a-z_]{0,8}".prop_map(|s| format!("\"{s}\"")),
        any::<bool>().prop_map(|b| b.to_string()),
        Just("1979-05-27T07:32:00Z".to_string()),
    ];
    leaf.prop_recursive(3, 16, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(|v| format!("[{}]", v.join(", "))),
            prop::collection::vec((prop::sample::select(KEYS), inner), 0..4).prop_map(|kv| format!(
                "{{ {} }}",
                kv.iter().map(|(k, v)| format!("\"{k}\" = {v}")).collect::<Vec<_>>().join(", ")
            )),
        ]
    })
}

fn document() -> impl Strategy<Value = String> {
    prop::collection::vec(
        (
            prop::collection::vec(prop::sample::select(KEYS), 1..3),
            prop::collection::vec((prop::sample::select(KEYS), value()), 0..5),
        ),
        0..6,
    )
    .prop_map(|tables| {
        let mut out = String::new();
        for (header, kvs) in tables {
            out.push_str(&format!("[{}]\n", header.iter().map(|h| format!("\"{h}\"")).collect::<Vec<_>>().join(".")));
            for (k, v) in kvs {
                out.push_str(&format!("\"{k}\" = {v}\n"));
            }
        }
        out
    })
}

fn load(text: String, sets: Vec<String>) {
    let source = RecipeSource::Builtin(builtin::find("tiny-offline").unwrap());
    if let Err(e) = load_text(source, text, &Overrides { sets, env: vec![] }) {
        // Rendering must not panic either (spans always inside their source).
        let shown = rtune::ui::render_plain(&e);
        assert!(shown.contains("rtune::recipe"), "{shown}");
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    #[test]
    fn random_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        load(String::from_utf8_lossy(&bytes).into_owned(), vec![]);
    }

    #[test]
    fn random_toml_never_panics(doc in document()) {
        load(doc, vec![]);
    }

    #[test]
    fn random_sets_on_a_valid_recipe_never_panic(
        sets in prop::collection::vec((prop::collection::vec(prop::sample::select(KEYS), 1..4), value()), 0..4),
        junk in "[ -~]{0,24}",
    ) {
        let mut args: Vec<String> = sets.iter().map(|(k, v)| format!("{}={v}", k.join("."))).collect();
        args.push(junk);
        load(builtin::find("tiny-offline").unwrap().text.to_string(), args);
    }

    #[test]
    fn mutated_valid_recipes_never_panic(pos in 0usize..2000, byte in any::<u8>()) {
        let mut text = builtin::find("tiny-offline").unwrap().text.as_bytes().to_vec();
        let i = pos % text.len();
        text[i] = byte;
        load(String::from_utf8_lossy(&text).into_owned(), vec![]);
    }
}
