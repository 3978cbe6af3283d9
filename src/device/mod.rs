//! The only place that knows about hardware: which devices this build and machine have, which
//! dtypes each supports for training, and how a recipe's `[device]` policy resolves to one
//! device and dtype — with a reason for every preference that was skipped.
//!
//! Resolution is a pure function of the policy and an [`Inventory`], so it is tested with fake
//! inventories; only [`Inventory::probe`] touches the machine.

#[cfg(feature = "cuda")]
pub mod cuda;
pub mod host;
#[cfg(feature = "vulkan")]
pub mod vulkan;

use serde::Serialize;

use crate::recipe::{Dtype, Gpus};

/// What a device can be, as far as the policy is concerned.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum DeviceClass {
    Cpu,
    Cuda,
    Metal,
    Vulkan,
}

impl DeviceClass {
    pub fn as_str(self) -> &'static str {
        match self {
            DeviceClass::Cpu => "cpu",
            DeviceClass::Cuda => "cuda",
            DeviceClass::Metal => "metal",
            DeviceClass::Vulkan => "vulkan",
        }
    }

    /// How a policy and `rtune doctor` name device `ordinal` of this class: `cpu`, `cuda:1`,
    /// `metal`, `vulkan:0`.
    pub fn device_name(self, ordinal: usize) -> String {
        match self {
            DeviceClass::Cuda | DeviceClass::Vulkan => format!("{}:{ordinal}", self.as_str()),
            c => c.as_str().to_string(),
        }
    }
}

/// One device this build can use on this machine.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DeviceInfo {
    pub class: DeviceClass,
    pub ordinal: usize,
    pub name: String,
    /// Training dtypes in the order rtune would pick them.
    pub dtypes: Vec<Dtype>,
    pub memory_bytes: Option<u64>,
    /// Of that, what the driver says this process may still allocate, where it says (Vulkan
    /// with `VK_EXT_memory_budget`): less where other programs hold GPU memory.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memory_free_bytes: Option<u64>,
    /// Compute capability, driver: what else `rtune doctor` shows.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub details: Option<String>,
    /// Why this build cannot use the device although it is there.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub unusable: Option<String>,
    /// The PCI vendor id, where the API reports one (Vulkan).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub vendor_id: Option<u32>,
    /// A hardware GPU (false for CPUs and software drivers such as lavapipe).
    pub gpu: bool,
}

impl DeviceInfo {
    /// The CPU: bf16/f16 matmuls on the CPU go through slow conversion paths in candle, so f32
    /// is its one training dtype (see docs/devices.md).
    pub(crate) fn cpu(name: String, memory_bytes: Option<u64>) -> DeviceInfo {
        DeviceInfo {
            class: DeviceClass::Cpu,
            ordinal: 0,
            name,
            dtypes: vec![Dtype::F32],
            memory_bytes,
            memory_free_bytes: None,
            details: None,
            unusable: None,
            vendor_id: None,
            gpu: false,
        }
    }
}

/// What this build was compiled with, and the devices it found.
#[derive(Debug, Clone, Serialize)]
pub struct Inventory {
    pub cuda_feature: bool,
    pub metal_feature: bool,
    pub vulkan_feature: bool,
    /// Why no Vulkan device is listed although the feature is on (no loader, no driver), or
    /// that Vulkan was not probed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub vulkan_note: Option<String>,
    /// The Vulkan library that listed the devices ([`vulkan::libraries`]), where one did.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub vulkan_library: Option<String>,
    pub devices: Vec<DeviceInfo>,
    pub cpu_threads: usize,
}

impl Inventory {
    /// Look at this machine. Cheap: no device is initialised unless its feature is built in.
    /// `with_vulkan`: also ask the Vulkan loader (doctor, and policies that name a device served
    /// through Vulkan; creating a Vulkan instance costs tens of milliseconds).
    pub fn probe(with_vulkan: bool) -> Inventory {
        let cpu_threads = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
        #[allow(unused_mut)]
        let mut devices = vec![DeviceInfo::cpu(host::cpu_name().unwrap_or_else(|| "cpu".into()), host::total_memory())];
        #[cfg(feature = "cuda")]
        {
            let build_cap = cuda::BUILD_COMPUTE_CAP;
            for (i, d) in cuda::devices().into_iter().enumerate() {
                let (major, minor) = d.compute_capability;
                let cap = (major * 10 + minor) as u32;
                let unusable = (cap < build_cap).then(|| {
                    format!(
                        "{} has compute capability {major}.{minor}; this build's kernels need {}.{} or later (rebuild with CUDA_COMPUTE_CAP={cap})",
                        d.name,
                        build_cap / 10,
                        build_cap % 10
                    )
                });
                // bf16 tensor cores came with compute capability 8.0 (Ampere).
                let dtypes =
                    if major >= 8 { vec![Dtype::Bf16, Dtype::F16, Dtype::F32] } else { vec![Dtype::F16, Dtype::F32] };
                devices.push(DeviceInfo {
                    class: DeviceClass::Cuda,
                    ordinal: i,
                    name: d.name,
                    dtypes,
                    memory_bytes: Some(d.memory_bytes),
                    memory_free_bytes: None,
                    details: Some(format!(
                        "compute capability {major}.{minor}, {} driver{}",
                        d.driver,
                        if cuda::runs_candle_gguf_kernels(major, minor) {
                            String::new()
                        } else {
                            format!(
                                "; GGUF self-checks on candle's portable kernels (its fast ones are built for {}.{})",
                                build_cap / 10,
                                build_cap % 10
                            )
                        }
                    )),
                    unusable,
                    vendor_id: Some(VENDOR_NVIDIA),
                    gpu: true,
                });
            }
        }
        #[cfg(feature = "metal")]
        {
            if let Ok(candle_core::Device::Metal(m)) = candle_core::Device::new_metal(0) {
                // Apple GPUs share the machine's memory; Metal recommends how much of it one
                // process's GPU work should take.
                let d = m.device();
                devices.push(DeviceInfo {
                    class: DeviceClass::Metal,
                    ordinal: 0,
                    name: format!("Apple GPU ({})", d.architecture_name()),
                    dtypes: vec![Dtype::Bf16, Dtype::F16, Dtype::F32],
                    memory_bytes: Some(d.recommended_max_working_set_size() as u64),
                    memory_free_bytes: None,
                    details: Some("candle's Metal backend; memory: Metal's recommended working set".into()),
                    unusable: None,
                    vendor_id: None,
                    gpu: true,
                });
            }
        }
        #[allow(unused_mut)]
        let (mut vulkan_note, mut vulkan_library) = (None, None);
        #[cfg(feature = "vulkan")]
        if with_vulkan {
            match vulkan::devices() {
                Ok((found, library)) => {
                    if found.is_empty() {
                        vulkan_note = Some(format!("the Vulkan loader ({library}) lists no device"));
                    }
                    for (i, d) in found.into_iter().enumerate() {
                        devices.push(vulkan_device(i, d));
                    }
                    vulkan_library = Some(library);
                }
                Err(why) => vulkan_note = Some(why),
            }
        } else {
            vulkan_note = Some("not probed (the policy names no Vulkan device)".to_string());
        }
        #[cfg(not(feature = "vulkan"))]
        let _ = with_vulkan;
        Inventory {
            cuda_feature: cfg!(feature = "cuda"),
            metal_feature: cfg!(feature = "metal"),
            vulkan_feature: cfg!(feature = "vulkan"),
            vulkan_note,
            vulkan_library,
            devices,
            cpu_threads,
        }
    }

    /// A CPU-only inventory (tests, and planning that must not depend on the machine).
    pub fn cpu_only(threads: usize) -> Inventory {
        Inventory {
            cuda_feature: false,
            metal_feature: false,
            vulkan_feature: false,
            vulkan_note: None,
            vulkan_library: None,
            devices: vec![DeviceInfo::cpu("cpu".into(), None)],
            cpu_threads: threads,
        }
    }
}

/// The outcome of resolving a policy.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Resolution {
    pub class: DeviceClass,
    pub ordinal: usize,
    pub dtype: Dtype,
    /// Preferences passed over, with why.
    pub skipped: Vec<Skip>,
    /// Dtypes passed over on the chosen device, with why.
    pub dtype_notes: Vec<String>,
    /// The preference that named the device, where it is another name for it (`rocm` or
    /// `directml` resolved to a Vulkan GPU): its `[device.<name>]` table applies too.
    pub via: Option<String>,
    /// Further devices of the same kind that train alongside this one (data parallel,
    /// `device.gpus`), by ordinal.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub peers: Vec<usize>,
    /// Why fewer devices train than `device.gpus` asks for, or share less work than they could.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub peers_notes: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Skip {
    pub device: String,
    pub reason: String,
}

impl Resolution {
    /// The CPU in f32, with nothing skipped (exports, tests, benchmarks).
    pub fn cpu() -> Resolution {
        Resolution {
            class: DeviceClass::Cpu,
            ordinal: 0,
            dtype: Dtype::F32,
            skipped: Vec::new(),
            dtype_notes: Vec::new(),
            via: None,
            peers: Vec::new(),
            peers_notes: Vec::new(),
        }
    }

    /// `cpu`, `cuda:1`, `metal`, `vulkan:0`.
    pub fn device_name(&self) -> String {
        self.class.device_name(self.ordinal)
    }

    /// The ordinals of the devices that work, the chosen one first, then its peers.
    pub fn ordinals(&self) -> impl Iterator<Item = usize> + '_ {
        std::iter::once(self.ordinal).chain(self.peers.iter().copied())
    }

    /// The devices that train, the chosen one first: `cuda:0`, or `cuda:0+1` with a peer.
    pub fn devices_name(&self) -> String {
        let mut s = self.device_name();
        for p in &self.peers {
            s.push_str(&format!("+{p}"));
        }
        s
    }

    /// Take up to `gpus` devices like the chosen one (its class, vendor and kind of driver —
    /// a GPU or a software one — usable and supporting its dtype), in ordinal order after it;
    /// a note when that is fewer than asked, or the device cannot share its work.
    pub fn with_peers(mut self, gpus: Gpus, inv: &Inventory) -> Resolution {
        let most = gpus.most();
        if most <= 1 {
            return self;
        }
        if !matches!(self.class, DeviceClass::Cuda | DeviceClass::Vulkan) {
            self.peers_notes.push(format!(
                "gpus = {}: data parallel training runs on CUDA and Vulkan GPUs; {} trains alone",
                gpus_str(gpus),
                self.device_name()
            ));
            return self;
        }
        let chosen = inv.devices.iter().find(|d| d.class == self.class && d.ordinal == self.ordinal);
        let like = |d: &DeviceInfo| {
            d.class == self.class
                && d.ordinal != self.ordinal
                && d.unusable.is_none()
                && d.dtypes.contains(&self.dtype)
                && chosen.is_some_and(|c| c.vendor_id == d.vendor_id && c.gpu == d.gpu)
        };
        let mut found: Vec<usize> = inv.devices.iter().filter(|d| like(d)).map(|d| d.ordinal).collect();
        found.sort_unstable();
        found.truncate(most - 1);
        if let Gpus::Count(n) = gpus
            && found.len() + 1 < n as usize
        {
            self.peers_notes.push(format!(
                "gpus = {n}: only {} usable {} device{} like {} (same vendor, {}): training on {}",
                found.len() + 1,
                self.class.as_str(),
                if found.is_empty() { "" } else { "s" },
                self.device_name(),
                self.dtype.as_str(),
                found.len() + 1
            ));
        }
        self.peers = found;
        self
    }

    /// The override tables that apply, in the order they are merged (a later one wins): the
    /// class (`cuda`), the preference that chose the device where it is another name for it
    /// (`rocm`), the exact device (`cuda:1`).
    pub fn override_names(&self) -> Vec<String> {
        let mut names = vec![self.class.as_str().to_string()];
        names.extend(self.via.clone());
        names.push(self.device_name());
        names.dedup();
        names
    }

    /// The device to hand to candle.
    pub fn candle_device(&self) -> candle_core::Result<candle_core::Device> {
        match self.class {
            DeviceClass::Cpu => Ok(candle_core::Device::Cpu),
            DeviceClass::Cuda => {
                let device = candle_core::Device::new_cuda(self.ordinal)?;
                #[cfg(feature = "cuda")]
                cuda::use_gguf_kernels_that_run(self.ordinal);
                Ok(device)
            }
            DeviceClass::Metal => candle_core::Device::new_metal(self.ordinal),
            DeviceClass::Vulkan => Err(candle_core::Error::Msg("candle has no Vulkan backend".into())),
        }
    }

    pub fn candle_dtype(&self) -> candle_core::DType {
        self.dtype.candle()
    }
}

fn gpus_str(g: Gpus) -> String {
    match g {
        Gpus::Count(n) => n.to_string(),
        Gpus::All(_) => "\"all\"".into(),
    }
}

/// Why no device could be chosen.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("no preferred device is usable: {}", .tried.iter().map(|s| format!("{}: {}", s.device, s.reason)).collect::<Vec<_>>().join("; "))]
pub struct NoDevice {
    pub tried: Vec<Skip>,
}

/// Pick the first preferred device that is present, then the first preferred dtype it supports.
pub fn resolve(prefer: &[String], dtypes: &[Dtype], inv: &Inventory) -> Result<Resolution, NoDevice> {
    resolve_with(prefer, |_| dtypes.to_vec(), inv)
}

/// [`resolve`] with a dtype preference per device (`dtypes_for("rocm")`).
pub fn resolve_with(
    prefer: &[String],
    dtypes_for: impl Fn(&str) -> Vec<Dtype>,
    inv: &Inventory,
) -> Result<Resolution, NoDevice> {
    let mut skipped = Vec::new();
    for want in prefer {
        match find(want, inv) {
            Ok(dev) => {
                let mut notes = Vec::new();
                let dtypes = dtypes_for(want);
                for d in &dtypes {
                    if dev.dtypes.contains(d) {
                        return Ok(Resolution {
                            class: dev.class,
                            ordinal: dev.ordinal,
                            dtype: *d,
                            skipped,
                            dtype_notes: notes,
                            via: (dev.class.as_str() != crate::recipe::device_name_parts(want).0).then(|| want.clone()),
                            peers: Vec::new(),
                            peers_notes: Vec::new(),
                        });
                    }
                    notes.push(format!("{}: {} does not train in {}", d.as_str(), dev.class.as_str(), d.as_str()));
                }
                let supported = dev.dtypes.iter().map(|d| d.as_str()).collect::<Vec<_>>().join(", ");
                skipped.push(Skip {
                    device: want.clone(),
                    reason: format!("none of the preferred dtypes is supported here (it supports {supported})"),
                });
            }
            Err(reason) => skipped.push(Skip { device: want.clone(), reason }),
        }
    }
    Err(NoDevice { tried: skipped })
}

fn find<'a>(want: &str, inv: &'a Inventory) -> Result<&'a DeviceInfo, String> {
    let (base, index) = crate::recipe::device_name_parts(want);
    let ordinal = index.and_then(|n| n.parse::<usize>().ok());
    match base {
        "cpu" => inv.devices.iter().find(|d| d.class == DeviceClass::Cpu).ok_or_else(|| "no CPU device".into()),
        "cuda" => {
            if !inv.cuda_feature {
                return Err("this build has no CUDA support (build with `--features cuda`)".into());
            }
            numbered(inv, DeviceClass::Cuda, "CUDA", ordinal, || {
                "no CUDA device found (driver missing or no GPU)".into()
            })
        }
        // candle's Metal backend where the build has it and finds the GPU; else the Apple GPU
        // as MoltenVK serves it through Vulkan, to the GPU engine (the policy says so). Only a
        // Mac has one: elsewhere Vulkan is not asked ([`served_through_vulkan`]).
        "metal" => {
            if let Some(d) = inv.devices.iter().find(|d| d.class == DeviceClass::Metal) {
                return Ok(d);
            }
            let apple = inv
                .devices
                .iter()
                .find(|d| d.class == DeviceClass::Vulkan && d.vendor_id == Some(VENDOR_APPLE) && d.gpu);
            match apple {
                Some(d) => usable(d).map_err(|why| {
                    format!("metal resolves to vulkan:{} ({}) through Vulkan (MoltenVK), but {why}", d.ordinal, d.name)
                }),
                None if inv.metal_feature => Err("no Metal device found".into()),
                None if !inv.vulkan_feature || !cfg!(target_os = "macos") => {
                    Err("this build has no Metal support (build with `--features metal` on macOS)".into())
                }
                None => Err("this build has no Metal support (build with `--features metal` on macOS), and no \
                             Apple GPU is visible through Vulkan (MoltenVK)"
                    .into()),
            }
        }
        "vulkan" => {
            if !inv.vulkan_feature {
                return Err("this build has no Vulkan support (build with `--features vulkan`)".into());
            }
            // Plain `vulkan` is the first usable GPU, before software drivers (lavapipe) that
            // the loader may list first; `vulkan:N` is exactly device N.
            let gpu = inv.devices.iter().find(|d| d.class == DeviceClass::Vulkan && d.gpu && d.unusable.is_none());
            if let (None, Some(d)) = (ordinal, gpu) {
                return Ok(d);
            }
            numbered(inv, DeviceClass::Vulkan, "Vulkan", ordinal, || match &inv.vulkan_note {
                Some(why) => format!("no Vulkan device found: {why}"),
                None => "no Vulkan device found".into(),
            })
        }
        // AMD (ROCm) and AMD or Intel (DirectML) GPUs are served through Vulkan, the one API
        // rtune reaches them by; the policy says which Vulkan device a preference became.
        "rocm" | "directml" => {
            let (vendors, gpus, own_api): (&[u32], _, _) = if base == "rocm" {
                (&[VENDOR_AMD], "AMD", "candle has no ROCm backend")
            } else {
                (&[VENDOR_AMD, VENDOR_INTEL], "AMD or Intel", "DirectML is Windows/PyTorch-only")
            };
            let gpu = inv
                .devices
                .iter()
                .find(|d| d.class == DeviceClass::Vulkan && d.vendor_id.is_some_and(|v| vendors.contains(&v)) && d.gpu);
            match gpu {
                Some(d) => usable(d).map_err(|why| {
                    format!("{base} resolves to vulkan:{} ({}) through Vulkan, but {why}", d.ordinal, d.name)
                }),
                None if !inv.vulkan_feature => {
                    Err(format!("{own_api}, and this build has no Vulkan support (build with `--features vulkan`)"))
                }
                None => Err(format!(
                    "no {gpus} GPU is visible through Vulkan ({own_api}; rtune reaches these GPUs through Vulkan)"
                )),
            }
        }
        "wgpu" => Err("`wgpu` is not a device: Vulkan GPUs are `vulkan` or `vulkan:N`".into()),
        other => Err(format!("unknown device `{other}`")),
    }
}

/// Whether a preference list names a device rtune reaches through Vulkan (so planning asks the
/// Vulkan loader only then): `metal` too on a Mac, where MoltenVK may serve the Apple GPU.
pub fn served_through_vulkan(prefer: &[String]) -> bool {
    let through =
        |base: &str| ["vulkan", "rocm", "directml"].contains(&base) || (base == "metal" && cfg!(target_os = "macos"));
    prefer.iter().any(|p| through(crate::recipe::device_name_parts(p).0))
}

/// Device `ordinal` (default 0) of a numbered class (`cuda:N`, `vulkan:N`), or why not: `none`
/// when the class has no device at all.
fn numbered<'a>(
    inv: &'a Inventory,
    class: DeviceClass,
    api: &str,
    ordinal: Option<usize>,
    none: impl FnOnce() -> String,
) -> Result<&'a DeviceInfo, String> {
    let found: Vec<&DeviceInfo> = inv.devices.iter().filter(|d| d.class == class).collect();
    match found.iter().find(|d| d.ordinal == ordinal.unwrap_or(0)) {
        Some(d) => usable(d),
        None if found.is_empty() => Err(none()),
        None => Err(format!("only {} {api} device{} present", found.len(), plural(found.len()))),
    }
}

fn usable(d: &DeviceInfo) -> Result<&DeviceInfo, String> {
    match &d.unusable {
        Some(why) => Err(why.clone()),
        None => Ok(d),
    }
}

fn plural(n: usize) -> &'static str {
    if n == 1 { "" } else { "s" }
}

/// PCI vendor ids, as Vulkan reports them.
pub const VENDOR_AMD: u32 = 0x1002;
pub const VENDOR_INTEL: u32 = 0x8086;
/// Apple's GPUs as MoltenVK lists them.
pub const VENDOR_APPLE: u32 = 0x106b;
pub const VENDOR_NVIDIA: u32 = 0x10de;

#[cfg(feature = "vulkan")]
fn vulkan_device(ordinal: usize, d: vulkan::VulkanInfo) -> DeviceInfo {
    // bf16 and f16 need only 16-bit storage: the kernels convert to f32 for arithmetic.
    let mut dtypes = Vec::new();
    if d.storage16 {
        dtypes.extend([Dtype::Bf16, Dtype::F16]);
    }
    dtypes.push(Dtype::F32);
    DeviceInfo {
        class: DeviceClass::Vulkan,
        ordinal,
        name: d.name.clone(),
        dtypes,
        memory_bytes: Some(d.memory_bytes),
        memory_free_bytes: d.memory_free_bytes,
        details: Some(format!(
            "{} {} device, Vulkan {}, {}; {}subgroups of {}{}; cooperative matrices: {}{}",
            d.vendor(),
            d.kind,
            d.api,
            d.driver,
            d.compute_units.map(|n| format!("{n} compute units, ")).unwrap_or_default(),
            d.subgroup,
            d.subgroup_range.map(|(lo, hi)| format!(" ({lo}–{hi})")).unwrap_or_default(),
            match (d.cooperative_matrix, d.matrix_shapes.is_empty()) {
                (false, _) => "no".to_string(),
                (true, true) if !d.matrix_missing.is_empty() => {
                    format!("listed, but the engine's kernels need {}", d.matrix_missing.join(", "))
                }
                (true, true) => "none the engine can use".to_string(),
                (true, false) => d.matrix_shapes.iter().map(|s| s.to_string()).collect::<Vec<_>>().join(", "),
            },
            // Only where it binds: below the memory, one buffer (a full fine-tune's trained
            // weights, their moments) can be no larger.
            if d.max_allocation_bytes < d.memory_bytes {
                format!("; one allocation at most {}", crate::ui::human_bytes(d.max_allocation_bytes))
            } else {
                String::new()
            }
        )),
        unusable: (!d.missing.is_empty())
            .then(|| format!("the GPU engine needs {} on Vulkan, which this device lacks", d.missing.join(", "))),
        vendor_id: Some(d.vendor_id),
        gpu: d.is_gpu(),
    }
}

/// Why the engine `requested` (`RTUNE_ENGINE`) cannot run on a Vulkan device: candle has no
/// Vulkan backend, so the GPU engine is the only engine there (`engine::choose` and the plan
/// both ask).
pub fn vulkan_engine_refused(requested: Option<&str>) -> Option<String> {
    requested
        .filter(|e| *e != "gpu")
        .map(|e| format!("RTUNE_ENGINE={e}: on Vulkan devices rtune trains with its GPU engine only (`gpu`)"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu_box(n_cuda: usize) -> Inventory {
        let mut inv = Inventory::cpu_only(2);
        inv.cuda_feature = true;
        for i in 0..n_cuda {
            inv.devices.push(DeviceInfo {
                class: DeviceClass::Cuda,
                ordinal: i,
                name: format!("cuda:{i}"),
                dtypes: vec![Dtype::Bf16, Dtype::F16, Dtype::F32],
                memory_bytes: None,
                memory_free_bytes: None,
                details: None,
                unusable: None,
                vendor_id: None,
                gpu: true,
            });
        }
        inv
    }

    fn s(v: &[&str]) -> Vec<String> {
        v.iter().map(|x| x.to_string()).collect()
    }

    /// `doctor`'s line for a Vulkan device: its matrix shapes, subgroups, and the largest
    /// allocation only where it is below the memory (where it decides what fits in one buffer).
    #[cfg(feature = "vulkan")]
    #[test]
    fn a_vulkan_device_line_names_its_allocation_limit_where_it_binds() {
        let gib = 1u64 << 30;
        let info = |max_allocation_bytes, matrix_missing| vulkan::VulkanInfo {
            name: "AMD Radeon RX 7900 XTX (RADV NAVI31)".into(),
            vendor_id: VENDOR_AMD,
            kind: "discrete",
            driver: "radv Mesa 25.0.0".into(),
            api: "1.3".into(),
            memory_bytes: 24 * gib,
            memory_free_bytes: None,
            storage16: true,
            bf16: false,
            cooperative_matrix: true,
            matrix_shapes: vec![],
            matrix_missing,
            subgroup: 64,
            subgroup_range: Some((32, 64)),
            compute_units: Some(96),
            max_allocation_bytes,
            missing: vec![],
        };
        let capped = vulkan_device(0, info(4 * gib, vec![])).details.unwrap();
        assert!(capped.ends_with("; one allocation at most 4.0 GiB"), "{capped}");
        assert!(
            capped.contains("96 compute units, subgroups of 64 (32–64); cooperative matrices: none the engine can use"),
            "{capped}"
        );
        let whole = vulkan_device(0, info(24 * gib, vec![])).details.unwrap();
        assert!(!whole.contains("allocation"), "{whole}");
        // A driver listing the extension without what the kernels need says what it lacks.
        let lacking = vulkan_device(0, info(24 * gib, vec!["computeFullSubgroups"])).details.unwrap();
        assert!(
            lacking.contains("cooperative matrices: listed, but the engine's kernels need computeFullSubgroups"),
            "{lacking}"
        );
    }

    #[test]
    fn falls_back_to_cpu_with_reasons() {
        let r = resolve(&s(&["rocm", "cuda", "metal", "cpu"]), &[Dtype::Bf16, Dtype::F32], &Inventory::cpu_only(2))
            .unwrap();
        assert_eq!(r.device_name(), "cpu");
        assert_eq!(r.dtype, Dtype::F32);
        let reasons: Vec<&str> = r.skipped.iter().map(|s| s.device.as_str()).collect();
        assert_eq!(reasons, ["rocm", "cuda", "metal"]);
        assert!(r.skipped[1].reason.contains("--features cuda"));
        assert_eq!(r.dtype_notes, ["bf16: cpu does not train in bf16"]);
    }

    #[test]
    fn picks_second_cuda_and_reports_missing_ordinals() {
        let inv = gpu_box(1);
        let r = resolve(&s(&["cuda:1", "cuda:0"]), &[Dtype::Bf16], &inv).unwrap();
        assert_eq!(r.device_name(), "cuda:0");
        assert_eq!(r.skipped[0].reason, "only 1 CUDA device present");
        assert_eq!(r.override_names(), ["cuda", "cuda:0"]);
    }

    #[test]
    fn more_gpus_train_alongside_the_chosen_one_where_they_are_like_it() {
        use crate::recipe::AllWord;
        let inv = gpu_box(3);
        let on = |prefer: &[&str], gpus, inv: &Inventory| {
            let r = resolve(&s(prefer), &[Dtype::Bf16, Dtype::F32], inv).unwrap().with_peers(gpus, inv);
            (r.devices_name(), r.peers_notes.first().cloned())
        };
        assert_eq!(on(&["cuda"], Gpus::Count(1), &inv), ("cuda:0".into(), None));
        assert_eq!(on(&["cuda"], Gpus::Count(2), &inv), ("cuda:0+1".into(), None));
        assert_eq!(on(&["cuda"], Gpus::All(AllWord::All), &inv), ("cuda:0+1+2".into(), None));
        // The named device first, then the others in order.
        assert_eq!(on(&["cuda:2"], Gpus::Count(2), &inv), ("cuda:2+0".into(), None));
        let (name, note) = on(&["cuda"], Gpus::Count(5), &inv);
        assert_eq!(name, "cuda:0+1+2");
        assert_eq!(
            note.unwrap(),
            "gpus = 5: only 3 usable cuda devices like cuda:0 (same vendor, bf16): training on 3"
        );
        // Through Vulkan, only GPUs of the chosen one's vendor and kind join it: not lavapipe,
        // not the Intel GPU, not an AMD GPU the engine cannot use.
        let inv = vulkan_box(&[
            (0x10005, false, None),
            (VENDOR_AMD, true, None),
            (VENDOR_INTEL, true, None),
            (VENDOR_AMD, true, Some("lacks bufferDeviceAddress")),
            (VENDOR_AMD, true, None),
        ]);
        assert_eq!(on(&["rocm"], Gpus::All(AllWord::All), &inv), ("vulkan:1+4".into(), None));
        // lavapipe pairs with lavapipe only (CI's two software devices).
        assert_eq!(on(&["vulkan:0"], Gpus::All(AllWord::All), &inv).0, "vulkan:0");
        // The CPU trains alone, and the plan says why.
        let (name, note) = on(&["cpu"], Gpus::Count(2), &Inventory::cpu_only(2));
        assert_eq!(name, "cpu");
        assert!(note.unwrap().contains("data parallel training runs on CUDA and Vulkan GPUs; cpu trains alone"));
    }

    #[test]
    fn cuda_build_without_gpu_says_so() {
        let r = resolve(&s(&["cuda", "cpu"]), &[Dtype::F32], &gpu_box(0)).unwrap();
        assert_eq!(r.skipped[0].reason, "no CUDA device found (driver missing or no GPU)");
    }

    #[test]
    fn nothing_usable_lists_everything_tried() {
        let e = resolve(&s(&["rocm", "metal"]), &[Dtype::F32], &Inventory::cpu_only(2)).unwrap_err();
        assert_eq!(e.tried.len(), 2);
        assert!(e.to_string().starts_with(
            "no preferred device is usable: rocm: candle has no ROCm backend, and this build has no Vulkan"
        ));
    }

    #[test]
    fn a_device_can_have_its_own_dtypes() {
        // `[device.cuda] dtype = ["bf16"]` with `dtype = ["f32"]` for the rest.
        let dtypes = |d: &str| if d.starts_with("cuda") { vec![Dtype::Bf16] } else { vec![Dtype::F32] };
        let r = resolve_with(&s(&["cuda:1", "cuda", "cpu"]), dtypes, &gpu_box(1)).unwrap();
        assert_eq!((r.device_name(), r.dtype), ("cuda:0".to_string(), Dtype::Bf16));
        let r = resolve_with(&s(&["cuda", "cpu"]), dtypes, &Inventory::cpu_only(2)).unwrap();
        assert_eq!(r.dtype, Dtype::F32);
    }

    #[test]
    fn dtype_nobody_supports_skips_the_device() {
        let e = resolve(&s(&["cpu"]), &[Dtype::Bf16], &Inventory::cpu_only(2)).unwrap_err();
        assert!(e.tried[0].reason.contains("supports f32"));
    }

    fn vulkan_box(gpus: &[(u32, bool, Option<&str>)]) -> Inventory {
        let mut inv = Inventory::cpu_only(2);
        inv.vulkan_feature = true;
        for (i, (vendor, gpu, unusable)) in gpus.iter().enumerate() {
            inv.devices.push(DeviceInfo {
                class: DeviceClass::Vulkan,
                ordinal: i,
                name: format!("gpu{i}"),
                dtypes: vec![Dtype::F16, Dtype::F32],
                memory_bytes: None,
                memory_free_bytes: None,
                details: None,
                unusable: unusable.map(str::to_string),
                vendor_id: Some(*vendor),
                gpu: *gpu,
            });
        }
        inv
    }

    #[test]
    fn rocm_and_directml_resolve_to_a_vulkan_gpu_of_their_vendor() {
        // A software driver (lavapipe) first, then an Intel and an AMD GPU that lack features.
        const LACKS: &str = "the GPU engine needs bufferDeviceAddress on Vulkan, which this device lacks";
        let inv = vulkan_box(&[
            (0x10005, false, Some(LACKS)),
            (VENDOR_INTEL, true, Some(LACKS)),
            (VENDOR_AMD, true, Some(LACKS)),
        ]);
        let e = resolve(&s(&["rocm", "directml", "vulkan:7", "vulkan"]), &[Dtype::F32], &inv).unwrap_err();
        let reasons: Vec<&str> = e.tried.iter().map(|t| t.reason.as_str()).collect();
        assert!(reasons[0].starts_with("rocm resolves to vulkan:2 (gpu2) through Vulkan, but the GPU engine needs"));
        assert!(reasons[1].starts_with("directml resolves to vulkan:1 (gpu1) through Vulkan"), "{}", reasons[1]);
        assert_eq!(reasons[2], "only 3 Vulkan devices present");
        assert_eq!(reasons[3], LACKS);
        // Usable devices: the mapping is the resolution, and plain `vulkan` is the first GPU.
        let inv = vulkan_box(&[(0x10005, false, None), (VENDOR_AMD, true, None)]);
        let r = resolve(&s(&["rocm", "cpu"]), &[Dtype::Bf16, Dtype::F16], &inv).unwrap();
        assert_eq!((r.device_name(), r.dtype), ("vulkan:1".to_string(), Dtype::F16));
        // `[device.rocm]` applies to what `rocm` became, between `[device.vulkan]` and
        // `[device.vulkan:1]`.
        assert_eq!(r.override_names(), ["vulkan", "rocm", "vulkan:1"]);
        let r = resolve(&s(&["vulkan"]), &[Dtype::F32], &inv).unwrap();
        assert_eq!(r.device_name(), "vulkan:1");
        assert_eq!(r.override_names(), ["vulkan", "vulkan:1"]);
        let r = resolve(&s(&["vulkan:0"]), &[Dtype::F32], &inv).unwrap();
        assert_eq!(r.device_name(), "vulkan:0");
        // Only a software device: rocm finds no AMD GPU, vulkan takes the software one.
        let inv = vulkan_box(&[(0x10005, false, None)]);
        let r = resolve(&s(&["rocm", "vulkan", "cpu"]), &[Dtype::F32], &inv).unwrap();
        assert_eq!(r.device_name(), "vulkan:0");
        assert!(r.skipped[0].reason.starts_with("no AMD GPU is visible through Vulkan"));
    }

    #[test]
    fn metal_is_candles_metal_where_built_else_an_apple_gpu_through_vulkan() {
        // A default build on a Mac with MoltenVK: `metal` becomes the Apple GPU's Vulkan device.
        let inv = vulkan_box(&[(VENDOR_APPLE, true, None)]);
        let r = resolve(&s(&["metal", "cpu"]), &[Dtype::Bf16, Dtype::F16], &inv).unwrap();
        assert_eq!((r.device_name(), r.dtype), ("vulkan:0".to_string(), Dtype::F16));
        assert_eq!(r.via.as_deref(), Some("metal"));
        assert_eq!(r.override_names(), ["vulkan", "metal", "vulkan:0"]);
        // One the engine cannot use says why; none at all says what would give one.
        let inv = vulkan_box(&[(VENDOR_APPLE, true, Some("the GPU engine needs shaderInt64"))]);
        let r = resolve(&s(&["metal", "cpu"]), &[Dtype::F32], &inv).unwrap();
        assert_eq!(
            r.skipped[0].reason,
            "metal resolves to vulkan:0 (gpu0) through Vulkan (MoltenVK), but the GPU engine needs shaderInt64"
        );
        let r = resolve(&s(&["metal", "cpu"]), &[Dtype::F32], &vulkan_box(&[(VENDOR_AMD, true, None)])).unwrap();
        let no_metal = "this build has no Metal support (build with `--features metal` on macOS)";
        match cfg!(target_os = "macos") {
            true => assert_eq!(
                r.skipped[0].reason,
                format!("{no_metal}, and no Apple GPU is visible through Vulkan (MoltenVK)")
            ),
            false => assert_eq!(r.skipped[0].reason, no_metal),
        }
        let r = resolve(&s(&["metal", "cpu"]), &[Dtype::F32], &Inventory::cpu_only(2)).unwrap();
        assert_eq!(r.skipped[0].reason, "this build has no Metal support (build with `--features metal` on macOS)");
        // A build with candle's Metal backend uses it when it finds the GPU.
        let mut inv = vulkan_box(&[(VENDOR_APPLE, true, None)]);
        inv.metal_feature = true;
        let mut metal = DeviceInfo::cpu("metal".into(), None);
        (metal.class, metal.gpu) = (DeviceClass::Metal, true);
        inv.devices.push(metal);
        let r = resolve(&s(&["metal"]), &[Dtype::F32], &inv).unwrap();
        assert_eq!(r.device_name(), "metal");
        assert_eq!(served_through_vulkan(&s(&["metal"])), cfg!(target_os = "macos"));
    }

    #[test]
    fn vulkan_without_the_feature_or_a_loader_says_which() {
        let r = resolve(&s(&["vulkan", "cpu"]), &[Dtype::F32], &Inventory::cpu_only(2)).unwrap();
        assert!(r.skipped[0].reason.contains("--features vulkan"));
        let mut inv = vulkan_box(&[]);
        inv.vulkan_note = Some("no Vulkan loader (libvulkan.so.1: cannot open)".into());
        let r = resolve(&s(&["vulkan", "cpu"]), &[Dtype::F32], &inv).unwrap();
        assert_eq!(r.skipped[0].reason, "no Vulkan device found: no Vulkan loader (libvulkan.so.1: cannot open)");
        assert!(served_through_vulkan(&s(&["directml", "cpu"])) && !served_through_vulkan(&s(&["cuda", "cpu"])));
    }
}
