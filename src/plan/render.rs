//! Text and DOT renderings of a plan (JSON is the plan's own serialisation).

use std::fmt::Write;

use super::{Action, Plan};

/// The table `rtune plan` prints.
pub fn render_text(plan: &Plan) -> String {
    let mut out = String::new();
    let d = &plan.device;
    let _ = writeln!(out, "plan for recipe `{}` on {} ({})", plan.recipe, d.device_name(), d.dtype.as_str());
    for s in &d.skipped {
        let _ = writeln!(out, "  skipped {}: {}", s.device, s.reason);
    }
    // `rocm`, `directml` (and on a Mac `metal`) name GPUs rtune reaches through Vulkan.
    if let Some(want) = &d.via {
        let name = plan.device_info(d.class, d.ordinal).map_or("?", |i| i.name.as_str());
        let _ = writeln!(out, "  {want} resolves to {} ({name}) through Vulkan", d.device_name());
    }
    for n in &d.dtype_notes {
        let _ = writeln!(out, "  dtype {n}");
    }
    if !d.peers.is_empty() {
        let all: Vec<String> = d.ordinals().map(|o| d.class.device_name(o)).collect();
        let _ = writeln!(out, "  data parallel: training runs on {} GPUs at once ({})", all.len(), all.join(", "));
    }
    for n in &d.peers_notes {
        let _ = writeln!(out, "  note: {n}");
    }
    // lavapipe and SwiftShader are Vulkan on the CPU: a correctness device, far slower than the
    // CPU engine, which `prefer = ["vulkan", "cpu"]` on a machine whose GPU driver is missing
    // would otherwise choose silently.
    if let Some(info) =
        plan.device_info(d.class, d.ordinal).filter(|i| i.class == crate::device::DeviceClass::Vulkan && !i.gpu)
    {
        let _ = writeln!(
            out,
            "  note: {} ({}) is a software Vulkan driver running on the CPU, far slower than rtune's CPU \
             engine (`cpu`); if this machine has a GPU, its Vulkan driver was not found (`rtune doctor`)",
            d.device_name(),
            info.name
        );
    }
    out.push('\n');
    let rows: Vec<[String; 7]> = plan
        .stages
        .iter()
        .map(|s| {
            [
                s.name.clone() + if s.implicit { "*" } else { "" },
                s.kind.as_str().to_string(),
                if s.needs.is_empty() { "-".into() } else { s.needs.join(",") },
                // The device the stage computes on (quantize merges in f32, on the CPU after a
                // Vulkan run), which its key holds.
                match s.key.device() {
                    Some(k) => format!("{}/{}", k.resolution().devices_name(), k.dtype.as_str()),
                    None => "-".into(),
                },
                s.short().to_string(),
                s.action.as_str().to_string(),
                s.reason.clone(),
            ]
        })
        .collect();
    let header = ["STAGE", "KIND", "NEEDS", "DEVICE", "FINGERPRINT", "STATUS", "REASON"].map(String::from);
    let mut widths = header.clone().map(|h| h.chars().count());
    for r in &rows {
        for (i, c) in r.iter().enumerate() {
            widths[i] = widths[i].max(c.chars().count());
        }
    }
    for r in std::iter::once(&header).chain(rows.iter()) {
        let mut line = String::new();
        for (i, c) in r.iter().enumerate() {
            if i + 1 == r.len() {
                line.push_str(c);
            } else {
                let _ = write!(line, "{c:<w$}  ", w = widths[i]);
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    let runs = plan.stages.iter().filter(|s| s.action == Action::Run).count();
    let cached = plan.stages.iter().filter(|s| s.action == Action::Cached).count();
    let restores = plan.stages.iter().filter(|s| s.action == Action::Restore).count();
    let restore = if restores > 0 { format!(", {restores} to restore") } else { String::new() };
    let _ = writeln!(out, "\n{runs} to run{restore}, {cached} cached");
    if plan.stages.iter().any(|s| s.implicit) {
        out.push_str("* added by rtune because another stage needs it\n");
    }
    out
}

/// Graphviz DOT of the stage graph, coloured by action.
pub fn render_dot(plan: &Plan) -> String {
    let mut out = String::from("digraph plan {\n  rankdir=LR;\n  node [shape=box, style=rounded];\n");
    for s in &plan.stages {
        let color = match s.action {
            Action::Cached => "gray",
            Action::Run => "black",
            Action::Restore => "blue",
            Action::Skip => "lightgray",
        };
        let _ =
            writeln!(out, "  \"{}\" [label=\"{}\\n{} {}\", color={color}];", s.name, s.name, s.kind, s.action.as_str());
    }
    for s in &plan.stages {
        for n in &s.needs {
            let _ = writeln!(out, "  \"{n}\" -> \"{}\";", s.name);
        }
    }
    out.push_str("}\n");
    out
}

#[cfg(test)]
mod tests {
    use crate::device::{DeviceClass, DeviceInfo, Inventory, resolve};
    use crate::recipe::Dtype;

    /// A preference that names a GPU by its vendor's API says which Vulkan device it became.
    #[test]
    fn the_plan_says_what_rocm_became() {
        let mut inv = Inventory::cpu_only(2);
        inv.vulkan_feature = true;
        let mut gpu = DeviceInfo::cpu("AMD Radeon RX 7900 XTX (RADV NAVI31)".into(), None);
        (gpu.class, gpu.gpu, gpu.vendor_id) = (DeviceClass::Vulkan, true, Some(crate::device::VENDOR_AMD));
        inv.devices.push(gpu.clone());
        let plan = |prefer: &str| {
            let device = resolve(&[prefer.to_string()], &[Dtype::F32], &inv).unwrap();
            let p = super::Plan {
                recipe: "r".into(),
                device,
                threads: 2,
                offline: false,
                stages: vec![],
                devices: vec![gpu.clone()],
            };
            super::render_text(&p)
        };
        let text = plan("rocm");
        assert!(
            text.starts_with(
                "plan for recipe `r` on vulkan:0 (f32)\n  rocm resolves to vulkan:0 (AMD Radeon RX 7900 XTX (RADV NAVI31)) through Vulkan\n"
            ),
            "{text}"
        );
        assert!(!plan("vulkan").contains("resolves to"), "a device named as itself needs no note");
    }
}
