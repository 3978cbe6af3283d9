//! `rtune download`: a Hub repository into the shared Hugging Face cache.

use super::*;
use rtune::ui::{Ui, human_bytes};
use rtune::{Error, hub};

/// Run `rtune download` with its parsed arguments; the exit code on success.
pub fn run(g: &Global, a: DownloadArgs, ui: &Ui) -> Result<u8, Error> {
    let DownloadArgs { repo_id, revision, include, exclude, repo_type, token, offline } = a;
    let env = hub::HubEnv::from_env(token.as_deref(), offline);
    let repo = hub::RepoRef::new(&repo_id, repo_kind(repo_type), revision.as_deref())?;
    let client = hub::Client::new(env.clone());
    let cache = hub::HubCache::new(&env.cache_dir);
    let report = hub::snapshot(&client, &cache, &repo, &hub::Wanted { include, exclude }, ui)?;
    let fetched = report.files.iter().filter(|f| f.fetched).count();
    ui.status(
        "download",
        format!(
            "{} at {}: {} files ({} fetched, {}), checked against their digests",
            repo.display(),
            &report.commit[..12],
            report.files.len(),
            fetched,
            human_bytes(report.bytes_fetched)
        ),
    );
    if g.json {
        ui.out(format!("{}\n", serde_json::to_string_pretty(&report).expect("json")));
    } else {
        ui.out(format!("{}\n", report.snapshot.display()));
    }
    Ok(0)
}
