//! The command line's definition: clap only, no library types (tests/docs.rs compiles this file
//! on its own to parse every command the docs show).

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};

/// Declarative, reproducible LLM fine-tuning: one binary, one TOML recipe.
///
/// A recipe names a model, a dataset, an adapter, a device policy and stages (download,
/// tokenize, train, evaluate, …). rtune plans them as a graph of content-addressed artifacts
/// and runs only what changed.
#[derive(Debug, Parser)]
#[command(name = "rtune", version, max_term_width = 100)]
#[command(after_help = "Exit codes: 0 ok, 1 invalid recipe or input, 2 usage, 3 a stage failed, 4 lock mismatch,\n\
130 interrupted.\n\
Environment: RTUNE_CACHE_DIR (cache root), RTUNE_NO_PROGRESS (plain log lines), NO_COLOR,\n\
RTUNE_<SECTION>__<KEY>=value (recipe settings, e.g. RTUNE_STAGES__TRAIN__EPOCHS=2),\n\
RTUNE_ENGINE=candle|fused|gpu (ask for a training engine, to compare them; fingerprinted),\n\
RTUNE_PROFILE=1 (print the host's share of a training step),\n\
RTUNE_VULKAN_LIBRARY (the Vulkan loader or driver library to open).")]
pub struct Cli {
    #[command(flatten)]
    pub global: Global,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Args)]
pub struct Global {
    /// Artifact cache root [default: $XDG_CACHE_HOME/rtune or ~/.cache/rtune]
    #[arg(long, global = true, env = "RTUNE_CACHE_DIR", hide_env_values = true, value_name = "DIR")]
    pub cache_dir: Option<PathBuf>,
    /// Print only errors and data
    #[arg(short, long, global = true)]
    pub quiet: bool,
    /// Print more detail
    #[arg(short, long, global = true, conflicts_with = "quiet")]
    pub verbose: bool,
    /// Machine-readable JSON on stdout
    #[arg(long, global = true)]
    pub json: bool,
}

#[derive(Debug, Args, Clone, Default)]
pub struct RecipeArgs {
    /// A recipe file, a built-in recipe name (see `rtune ls`), or a name in ./recipes
    pub recipe: String,
    /// Override a setting with a TOML value, e.g. `--set stages.train.learning_rate=3e-4`
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub sets: Vec<String>,
}

#[derive(Debug, Args, Clone, Default)]
pub struct SelectArgs {
    /// Run only this stage (its inputs must already be built)
    #[arg(long, value_name = "STAGE", conflicts_with = "from")]
    pub only: Option<String>,
    /// Build this stage and the stages it needs, nothing downstream or beside it
    #[arg(long, value_name = "STAGE", conflicts_with = "only")]
    pub until: Option<String>,
    /// Re-run this stage and everything downstream of it
    #[arg(long, value_name = "STAGE")]
    pub from: Option<String>,
    /// Re-run this stage even if it is cached (repeatable)
    #[arg(long, value_name = "STAGE")]
    pub force: Vec<String>,
    /// Never use the network: Hub sources come from the HF cache (also HF_HUB_OFFLINE=1)
    #[arg(long)]
    pub offline: bool,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// List built-in recipes and those in ./recipes
    Ls,
    /// Copy a built-in recipe to a file to edit
    Cp {
        /// Built-in recipe name
        name: String,
        /// Destination file (or folder)
        dest: PathBuf,
    },
    /// Print a recipe; with --set, the layered result with every default filled in
    Cat {
        #[command(flatten)]
        recipe: RecipeArgs,
    },
    /// Check a recipe and report every problem at once (exit 1 if invalid)
    Validate {
        #[command(flatten)]
        recipe: RecipeArgs,
    },
    /// Show the stages, device, fingerprints, and what will run and why
    Plan {
        #[command(flatten)]
        recipe: RecipeArgs,
        #[command(flatten)]
        select: SelectArgs,
        /// Output format
        #[arg(long, value_enum, default_value_t = PlanFormat::Text)]
        format: PlanFormat,
    },
    /// Run a recipe: build every stage that is not cached
    Run {
        #[command(flatten)]
        recipe: RecipeArgs,
        #[command(flatten)]
        select: SelectArgs,
        /// Fail (exit 4) if any fingerprint differs from rtune.lock
        #[arg(long)]
        locked: bool,
    },
    /// Show what goes into a stage's fingerprint; --diff compares with the last run
    Explain {
        #[command(flatten)]
        recipe: RecipeArgs,
        /// Stage name
        stage: String,
        /// Compare with the fingerprint recorded in rtune.lock
        #[arg(long)]
        diff: bool,
    },
    /// Talk to a trained model: a terminal chat, or answers to prompts for scripts
    ///
    /// TARGET is a recipe (the result of its train stage, once `rtune run` built it, on the device
    /// the recipe's policy picks) or a model folder (a merged export or a PEFT adapter folder, on
    /// the CPU). Turns are rendered with the chat template the model trained with. On a terminal,
    /// replies stream as they are generated; `/reset` starts over, `/exit` (or Ctrl-D) ends.
    /// With `--prompt`, or with stdin not a terminal (one turn per line), it answers and exits.
    Chat(ChatArgs),
    /// Download a repository from the Hugging Face Hub into the shared HF cache
    ///
    /// Files land in the layout huggingface_hub uses ($HF_HUB_CACHE, or $HF_HOME/hub, or
    /// ~/.cache/huggingface/hub), so Python tools and rtune share one copy. Partial downloads
    /// resume; every file is checked against its digest. Prints the snapshot folder.
    Download(DownloadArgs),
    /// Upload files or folders to a Hub repo in one commit
    Upload(UploadArgs),
    /// Inspect and maintain the artifact cache
    Cache {
        #[command(subcommand)]
        command: CacheCommand,
    },
    /// Print the JSON Schema of recipes
    Schema,
    /// Show the devices this build can use, their dtypes and build features
    Doctor {
        /// Also run each GPU's products and attention in every dtype it trains in: which kernels
        /// run (matrix units after their first-use checks, or what stands in) and the products'
        /// rate (a few seconds per GPU)
        #[arg(long)]
        check: bool,
    },
}

#[derive(Debug, Subcommand)]
pub enum CacheCommand {
    /// List artifacts: fingerprint, kind, stage, size
    Ls,
    /// Re-hash every artifact, report damage (exit 1 if any) and mark it for rebuilding
    Verify,
    /// Remove what no manifest reaches
    Gc,
    /// Remove artifacts (or a stopped run's resumable work) by fingerprint, then what only they used
    Rm {
        /// Fingerprints, or prefixes of them as `cache ls` and `plan` show them
        #[arg(required = true, value_name = "FINGERPRINT")]
        fingerprints: Vec<String>,
        /// Say what would be removed and freed; remove nothing
        #[arg(long)]
        dry_run: bool,
    },
    /// Remove every artifact and stopped run that the named recipes do not use, then what only they used
    Prune {
        /// A recipe whose artifacts stay: those of its plan here, of its lock file, and their inputs (repeatable)
        #[arg(long = "keep", value_name = "RECIPE", required = true)]
        keep: Vec<String>,
        /// Say what would be removed and freed; remove nothing
        #[arg(long)]
        dry_run: bool,
    },
    /// Print the cache root
    Path,
}

#[derive(Debug, Args)]
pub struct ChatArgs {
    /// A recipe file, a built-in recipe name, or a model folder
    pub target: String,
    /// Override a recipe setting with a TOML value, as `rtune run --set`
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub sets: Vec<String>,
    /// The train stage to talk to [default: the recipe's only one]
    #[arg(long, value_name = "STAGE")]
    pub stage: Option<String>,
    /// Talk to the base model rather than the trained one
    #[arg(long)]
    pub base: bool,
    /// A system prompt: the conversation's first turn
    #[arg(long, value_name = "TEXT")]
    pub system: Option<String>,
    /// Answer this prompt and exit; repeated, the turns of one conversation
    #[arg(long, value_name = "TEXT")]
    pub prompt: Vec<String>,
    /// How answers are printed: text, or one JSON object per turn (also `--json`)
    #[arg(long, value_enum, default_value_t = ChatFormat::Text)]
    pub format: ChatFormat,
    /// Most tokens in one reply
    #[arg(long, default_value_t = 256, value_name = "N")]
    pub max_new_tokens: usize,
    /// Sampling temperature; 0 is greedy (transformers' `do_sample=False`)
    #[arg(long, default_value_t = 0.0, value_name = "T")]
    pub temperature: f64,
    /// Sample only from the K most likely tokens
    #[arg(long, value_name = "K")]
    pub top_k: Option<usize>,
    /// Sample only from the most likely tokens whose probabilities reach P
    #[arg(long, value_name = "P")]
    pub top_p: Option<f64>,
    /// Divide the logits of tokens already in the conversation by this (transformers' `repetition_penalty`)
    #[arg(long, default_value_t = 1.0, value_name = "X")]
    pub repetition_penalty: f64,
    /// Seed of the sampling
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ChatFormat {
    Text,
    Json,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum PlanFormat {
    Text,
    Json,
    Dot,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum RepoType {
    Model,
    Dataset,
}

#[derive(Debug, Args)]
pub struct DownloadArgs {
    /// Repository id, e.g. HuggingFaceTB/SmolLM2-135M
    pub repo_id: String,
    /// Branch, tag or commit [default: main]
    #[arg(long)]
    pub revision: Option<String>,
    /// Only files matching this pattern (repeatable; `*` crosses folders)
    #[arg(long, value_name = "GLOB")]
    pub include: Vec<String>,
    /// Skip files matching this pattern (repeatable)
    #[arg(long, value_name = "GLOB")]
    pub exclude: Vec<String>,
    #[arg(long, value_enum, default_value_t = RepoType::Model)]
    pub repo_type: RepoType,
    /// Access token [default: $HF_TOKEN, then the token file]; never printed
    #[arg(long, value_name = "TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// Resolve from the HF cache only (also HF_HUB_OFFLINE=1)
    #[arg(long)]
    pub offline: bool,
}

#[derive(Debug, Args)]
pub struct UploadArgs {
    /// Destination: owner/name[@revision]
    pub repo_id: String,
    /// Files or folders to upload (folders keep their layout)
    #[arg(required = true)]
    pub paths: Vec<PathBuf>,
    #[arg(long, value_enum, default_value_t = RepoType::Model)]
    pub repo_type: RepoType,
    /// Create the repo if it does not exist
    #[arg(long)]
    pub create: bool,
    /// With --create: make the new repo public (default private)
    #[arg(long)]
    pub public: bool,
    /// Commit message
    #[arg(long, short = 'm', default_value = "Upload with rtune")]
    pub message: String,
    /// Access token [default: $HF_TOKEN, then the token file]; never printed
    #[arg(long, value_name = "TOKEN")]
    pub token: Option<String>,
}
