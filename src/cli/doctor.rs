//! `rtune doctor`: what this build and machine can use, and with `--check` the GPU kernels' first-use checks.

use super::*;
use rtune::Error;
use rtune::device::Inventory;
use rtune::ui::{Ui, human_bytes};

/// Run `rtune doctor` with its parsed arguments; the exit code on success.
pub fn run(g: &Global, check: bool, ui: &Ui) -> Result<u8, Error> {
    let inv = Inventory::probe(true);
    let checks = if check { kernel_checks(&inv, ui) } else { Vec::new() };
    if g.json {
        let mut v = serde_json::to_value(&inv).expect("json");
        if check {
            v["checks"] = serde_json::to_value(&checks).expect("json");
        }
        ui.out(format!("{}\n", serde_json::to_string_pretty(&v).expect("json")));
        return Ok(0);
    }
    let mut out = format!(
        "rtune {} on {} {}\nbuild features: cuda={} metal={} vulkan={}\ncpu threads: {}\n{}\ndevices:\n",
        env!("CARGO_PKG_VERSION"),
        std::env::consts::OS,
        std::env::consts::ARCH,
        inv.cuda_feature,
        inv.metal_feature,
        inv.vulkan_feature,
        inv.cpu_threads,
        inv.vulkan_library.as_ref().map(|lib| format!("vulkan library: {lib}\n")).unwrap_or_default()
    );
    for d in &inv.devices {
        let mut mem = d.memory_bytes.map(human_bytes).unwrap_or_else(|| "unknown".into());
        if let Some(free) = d.memory_free_bytes {
            mem.push_str(&format!(" ({} free)", human_bytes(free)));
        }
        let dtypes = d.dtypes.iter().map(|t| t.as_str()).collect::<Vec<_>>().join(", ");
        let id = d.class.device_name(d.ordinal);
        out.push_str(&format!("  {id:<8} {}  memory {mem}  training dtypes: {dtypes}\n", d.name));
        if let Some(details) = &d.details {
            out.push_str(&format!("           {details}\n"));
        }
        if let Some(why) = &d.unusable {
            out.push_str(&format!("           unusable: {why}\n"));
        }
    }
    let all = rtune::recipe::Gpus::All(rtune::recipe::AllWord::All);
    for want in ["cuda", "metal", "vulkan", "rocm"] {
        match rtune::device::resolve(&[want.to_string()], &[rtune::recipe::Dtype::F32], &inv) {
            Err(e) => out.push_str(&format!("  {want:<8} unavailable: {}\n", e.tried[0].reason)),
            // Several GPUs of one kind can share a run (`device.gpus`).
            Ok(r) if want != "rocm" => {
                let r = r.with_peers(all, &inv);
                if !r.peers.is_empty() {
                    out.push_str(&format!(
                            "  {want:<8} {} GPUs can train together: `[device] gpus = {}` (or \"all\") with `prefer = [\"{want}\"]`\n",
                            r.peers.len() + 1,
                            r.peers.len() + 1
                        ));
                }
            }
            Ok(_) => {}
        }
    }
    if check {
        out.push_str(&checks_text(&checks));
    }
    ui.out(out);
    Ok(0)
}

/// `doctor --check` on one device: its name, and what it found or why it could not open.
#[derive(serde::Serialize)]
struct DeviceCheck {
    device: String,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    dtypes: Vec<rtune::engine::gpu::check::KernelCheck>,
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<String>,
}

/// Run the kernel checks on every usable GPU the GPU engine runs on.
fn kernel_checks(inv: &Inventory, ui: &Ui) -> Vec<DeviceCheck> {
    use rtune::device::DeviceClass;
    let gpus = inv.devices.iter().filter(|d| matches!(d.class, DeviceClass::Cuda | DeviceClass::Vulkan));
    gpus.filter(|d| d.unusable.is_none())
        .map(|d| {
            let device = d.class.device_name(d.ordinal);
            ui.status("checking", format!("{device} ({})", d.name));
            match rtune::engine::gpu::open_device(d.class, d.ordinal, false) {
                Ok(gpu) => {
                    let dts: Vec<_> = d.dtypes.iter().map(|&t| rtune::engine::gpu::compute_dtype(t)).collect();
                    DeviceCheck { device, dtypes: rtune::engine::gpu::check::check(&gpu, &dts), error: None }
                }
                Err(e) => DeviceCheck { device, dtypes: Vec::new(), error: Some(e.to_string()) },
            }
        })
        .collect()
}

/// `doctor --check`'s findings as text.
fn checks_text(checks: &[DeviceCheck]) -> String {
    let mut out = String::from("\nkernel checks:\n");
    if checks.is_empty() {
        out.push_str("  no GPU for the GPU engine\n");
    }
    for c in checks {
        if let Some(e) = &c.error {
            out.push_str(&format!("  {:<8} cannot open: {e}\n", c.device));
        }
        for k in &c.dtypes {
            let rate = match (k.tflops, k.size) {
                (Some(r), Some(n)) => format!(", {r:.3} TFLOP/s ({n}³)"),
                _ => String::new(),
            };
            out.push_str(&format!("  {:<8} {:<5} {}{rate}\n", c.device, k.dtype, k.products));
            out.push_str(&format!("  {:<8} {:<5} {}\n", "", "", k.attention));
            if let Some(e) = &k.error {
                out.push_str(&format!("  {:<8} {:<5} error: {e}\n", "", ""));
            }
        }
    }
    out
}
