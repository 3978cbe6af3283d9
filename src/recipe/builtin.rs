//! Recipes embedded in the binary (the files under `recipes/`).

#[derive(Debug)]
pub struct Builtin {
    pub name: &'static str,
    pub text: &'static str,
}

macro_rules! builtins {
    ($($name:literal),* $(,)?) => {
        &[$(Builtin { name: $name, text: include_str!(concat!("../../recipes/", $name, ".toml")) }),*]
    };
}

static ALL: &[Builtin] = builtins![
    "tiny-offline",
    "smollm2-135m-lora",
    "smollm2-360m-lora",
    "qwen2.5-0.5b-lora",
    "qwen2.5-1.5b-lora",
    "qwen2.5-3b-lora-rocm",
    "qwen3-0.6b-lora",
    "qwen3-8b-qlora",
    "gemma3-270m-lora",
    "gemma3-4b-lora",
    "llama-3.2-1b-chat",
    "smollm2-135m-full",
];

pub fn all() -> &'static [Builtin] {
    ALL
}

pub fn find(name: &str) -> Option<&'static Builtin> {
    let name = name.strip_suffix(".toml").unwrap_or(name);
    ALL.iter().find(|b| b.name == name)
}

impl Builtin {
    /// The recipe's `description`, read without checking the whole recipe.
    pub fn description(&self) -> String {
        toml::from_str::<toml::Table>(self.text)
            .ok()
            .and_then(|t| t.get("recipe")?.get("description")?.as_str().map(String::from))
            .unwrap_or_default()
    }
}

/// Data files the built-in recipes refer to by relative path, embedded too.
static DATA: &[(&str, &[u8])] =
    &[("data/synthetic-alpaca.jsonl", include_bytes!("../../recipes/data/synthetic-alpaca.jsonl"))];

/// The embedded data files a built-in recipe mentions.
pub fn data_files(b: &Builtin) -> Vec<(&'static str, &'static [u8])> {
    DATA.iter().filter(|(rel, _)| b.text.contains(rel)).copied().collect()
}

/// An embedded data file, extracted (once) to a folder named by its digest, so a built-in
/// recipe run by name finds its data wherever rtune is started.
pub fn extract(rel: &str) -> Option<std::path::PathBuf> {
    let (_, bytes) = DATA.iter().find(|(r, _)| *r == rel)?;
    let digest = blake3::hash(bytes).to_hex();
    let dir = std::env::temp_dir().join("rtune-builtin").join(&digest.as_str()[..16]);
    let path = dir.join(std::path::Path::new(rel).file_name()?);
    if !path.exists() {
        std::fs::create_dir_all(&dir).ok()?;
        crate::store::write_atomic(&path, bytes).ok()?;
    }
    Some(path)
}
