//! `rtune upload`: files or folders to a Hub repository in one commit.

use super::*;
use rtune::recipe::{self};
use rtune::ui::{Ui, count};
use rtune::{Error, hub};

/// Run `rtune upload` with its parsed arguments; the exit code on success.
pub fn run(g: &Global, a: UploadArgs, ui: &Ui) -> Result<u8, Error> {
    let UploadArgs { repo_id, paths, repo_type, create, public, message, token } = a;
    let env = hub::HubEnv::from_env(token.as_deref(), false);
    if env.offline {
        return Err(recipe::Problem::new("rtune::hub::offline", "cannot upload with HF_HUB_OFFLINE set")
            .help("unset HF_HUB_OFFLINE (or set it to 0) to upload")
            .into());
    }
    let (id, rev) = match repo_id.split_once('@') {
        Some((i, r)) => (i, Some(r)),
        None => (repo_id.as_str(), None),
    };
    let repo = hub::RepoRef::new(id, repo_kind(repo_type), rev)?;
    let mut files = Vec::new();
    for p in &paths {
        if p.is_dir() {
            for rel in rtune::store::walk(p).map_err(Error::io(format!("cannot list `{}`", p.display())))? {
                let path = rel.to_string_lossy().replace('\\', "/");
                if !path.split('/').any(|c| c.starts_with('.')) {
                    files.push(hub::CommitFile { path, local: p.join(&rel) });
                }
            }
        } else {
            let name = p.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_default();
            files.push(hub::CommitFile { path: name, local: p.clone() });
        }
    }
    let client = hub::Client::new(env);
    if create {
        hub::create_repo(&client, &repo, !public)?;
    }
    let report = hub::commit(&client, &repo, &files, &message, hub::Ignored::Skip, ui)?;
    let sent = files.len() - report.ignored.len();
    ui.status("upload", format!("{} → {} (commit {})", count(sent, "file"), repo.display(), &report.commit));
    if g.json {
        ui.out(format!("{}\n", serde_json::to_string_pretty(&report).expect("json")));
    } else {
        ui.out(format!("{}\n", report.url));
    }
    Ok(0)
}
