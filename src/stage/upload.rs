//! `upload`: publishes the exported models. `dir://path` (relative to the recipe's folder)
//! copies them there, each file written to a temporary name and renamed; `hf://` is rejected at
//! plan time until the hub layer lands.

use std::collections::BTreeMap;

use serde_json::json;

use super::{StageCtx, StageError, write_json};
use crate::recipe::UploadSettings;

pub fn run(ctx: &StageCtx<'_>) -> Result<serde_json::Value, StageError> {
    let s: UploadSettings = serde_json::from_value(ctx.stage.settings()["upload"].clone())
        .map_err(|e| StageError::Internal(format!("resolved upload settings: {e}")))?;
    let rel = s.to.strip_prefix("dir://").ok_or_else(|| StageError::Internal(format!("`{}` passed planning", s.to)))?;
    let dest = ctx.loaded.resolve_path(rel);
    let exports = ctx.input("exports")?;
    let mut files = BTreeMap::new();
    for relpath in crate::store::walk(&exports).map_err(StageError::io("cannot list the exports"))? {
        let src = exports.join(&relpath);
        let target = dest.join(&relpath);
        let parent = target.parent().unwrap_or(&dest).to_path_buf();
        std::fs::create_dir_all(&parent).map_err(StageError::io(format!("cannot create `{}`", parent.display())))?;
        let tmp = parent.join(format!(".rtune-upload-{}", std::process::id()));
        std::fs::copy(&src, &tmp).map_err(StageError::io(format!("cannot write `{}`", tmp.display())))?;
        // Copies of read-only cache objects are read-only too; the user owns these.
        let mut perm = std::fs::metadata(&tmp).map_err(StageError::io("cannot stat a copy"))?.permissions();
        #[allow(clippy::permissions_set_readonly_false)]
        perm.set_readonly(false);
        std::fs::set_permissions(&tmp, perm).map_err(StageError::io("cannot set permissions"))?;
        std::fs::rename(&tmp, &target).map_err(StageError::io(format!("cannot write `{}`", target.display())))?;
        let (digest, size) = crate::store::hash_file(&target).map_err(StageError::io("cannot hash a copy"))?;
        files.insert(relpath.to_string_lossy().replace('\\', "/"), json!({ "digest": digest, "size": size }));
    }
    ctx.ui.status("upload", format!("{} files → {}", files.len(), dest.display()));
    let record = json!({ "destination": s.to, "files": files });
    write_json(&ctx.out.join("upload.json"), &record)?;
    Ok(json!({ "destination": s.to, "path": dest, "files": files.len() }))
}
