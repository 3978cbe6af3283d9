//! The only place that knows about hardware: which devices this build and machine have, which
//! dtypes each supports for training, and how a recipe's `[device]` policy resolves to one
//! device and dtype — with a reason for every preference that was skipped.
//!
//! Resolution is a pure function of the policy and an [`Inventory`], so it is tested with fake
//! inventories; only [`Inventory::probe`] touches the machine.

#[cfg(feature = "cuda")]
pub mod cuda;

use serde::Serialize;

use crate::recipe::Dtype;

/// What a device can be, as far as the policy is concerned.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum DeviceClass {
    Cpu,
    Cuda,
    Metal,
}

impl DeviceClass {
    pub fn as_str(self) -> &'static str {
        match self {
            DeviceClass::Cpu => "cpu",
            DeviceClass::Cuda => "cuda",
            DeviceClass::Metal => "metal",
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
    /// Compute capability, driver: what else `rtune doctor` shows.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub details: Option<String>,
    /// Why this build cannot use the device although it is there.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub unusable: Option<String>,
}

/// What this build was compiled with, and the devices it found.
#[derive(Debug, Clone, Serialize)]
pub struct Inventory {
    pub cuda_feature: bool,
    pub metal_feature: bool,
    pub devices: Vec<DeviceInfo>,
    pub cpu_threads: usize,
}

impl Inventory {
    /// Look at this machine. Cheap: no device is initialised unless its feature is built in.
    pub fn probe() -> Inventory {
        let cpu_threads = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
        #[allow(unused_mut)]
        let mut devices = vec![DeviceInfo {
            class: DeviceClass::Cpu,
            ordinal: 0,
            name: cpu_name(),
            // bf16/f16 matmuls on CPU go through slow conversion paths in candle; f32 is the
            // one CPU training dtype (see docs/devices.md).
            dtypes: vec![Dtype::F32],
            memory_bytes: total_memory(),
            details: None,
            unusable: None,
        }];
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
                    details: Some(format!("compute capability {major}.{minor}, {} driver", d.driver)),
                    unusable,
                });
            }
        }
        #[cfg(feature = "metal")]
        {
            if candle_core::Device::new_metal(0).is_ok() {
                devices.push(DeviceInfo {
                    class: DeviceClass::Metal,
                    ordinal: 0,
                    name: "metal".into(),
                    dtypes: vec![Dtype::Bf16, Dtype::F16, Dtype::F32],
                    memory_bytes: None,
                    details: None,
                    unusable: None,
                });
            }
        }
        Inventory { cuda_feature: cfg!(feature = "cuda"), metal_feature: cfg!(feature = "metal"), devices, cpu_threads }
    }

    /// A CPU-only inventory (tests, and planning that must not depend on the machine).
    pub fn cpu_only(threads: usize) -> Inventory {
        Inventory {
            cuda_feature: false,
            metal_feature: false,
            devices: vec![DeviceInfo {
                class: DeviceClass::Cpu,
                ordinal: 0,
                name: "cpu".into(),
                dtypes: vec![Dtype::F32],
                memory_bytes: None,
                details: None,
                unusable: None,
            }],
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
        }
    }

    /// `cpu`, `cuda:1`, `metal`.
    pub fn device_name(&self) -> String {
        match self.class {
            DeviceClass::Cuda => format!("cuda:{}", self.ordinal),
            c => c.as_str().to_string(),
        }
    }

    /// The override table names that apply: the exact name first, then the class (`cuda`).
    pub fn override_names(&self) -> Vec<String> {
        let exact = self.device_name();
        let class = self.class.as_str().to_string();
        if exact == class { vec![class] } else { vec![class, exact] }
    }

    /// The device to hand to candle.
    pub fn candle_device(&self) -> candle_core::Result<candle_core::Device> {
        match self.class {
            DeviceClass::Cpu => Ok(candle_core::Device::Cpu),
            DeviceClass::Cuda => candle_core::Device::new_cuda(self.ordinal),
            DeviceClass::Metal => candle_core::Device::new_metal(self.ordinal),
        }
    }

    pub fn candle_dtype(&self) -> candle_core::DType {
        match self.dtype {
            Dtype::F32 => candle_core::DType::F32,
            Dtype::F16 => candle_core::DType::F16,
            Dtype::Bf16 => candle_core::DType::BF16,
        }
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
    let (base, ordinal) = match want.split_once(':') {
        Some((b, n)) => (b, n.parse::<usize>().ok()),
        None => (want, None),
    };
    match base {
        "cpu" => inv.devices.iter().find(|d| d.class == DeviceClass::Cpu).ok_or_else(|| "no CPU device".into()),
        "cuda" => {
            if !inv.cuda_feature {
                return Err("this build has no CUDA support (build with `--features cuda`)".into());
            }
            let cudas: Vec<&DeviceInfo> = inv.devices.iter().filter(|d| d.class == DeviceClass::Cuda).collect();
            let n = ordinal.unwrap_or(0);
            match cudas.iter().find(|d| d.ordinal == n) {
                Some(d) => match &d.unusable {
                    Some(why) => Err(why.clone()),
                    None => Ok(d),
                },
                None if cudas.is_empty() => Err("no CUDA device found (driver missing or no GPU)".into()),
                None => {
                    Err(format!("only {} CUDA device{} present", cudas.len(), if cudas.len() == 1 { "" } else { "s" }))
                }
            }
        }
        "metal" => {
            if !inv.metal_feature {
                return Err("this build has no Metal support (build with `--features metal` on macOS)".into());
            }
            inv.devices.iter().find(|d| d.class == DeviceClass::Metal).ok_or_else(|| "no Metal device found".into())
        }
        "rocm" => Err("candle has no ROCm backend, so no build of rtune can use AMD GPUs directly yet".into()),
        "vulkan" | "wgpu" => Err(format!("candle has no {base} backend")),
        "directml" => Err("DirectML is Windows/PyTorch-only; candle has no DirectML backend".into()),
        other => Err(format!("unknown device `{other}`")),
    }
}

fn cpu_name() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        })
        .unwrap_or_else(|| "cpu".into())
}

fn total_memory() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = s.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
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
                details: None,
                unusable: None,
            });
        }
        inv
    }

    fn s(v: &[&str]) -> Vec<String> {
        v.iter().map(|x| x.to_string()).collect()
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
    fn cuda_build_without_gpu_says_so() {
        let r = resolve(&s(&["cuda", "cpu"]), &[Dtype::F32], &gpu_box(0)).unwrap();
        assert_eq!(r.skipped[0].reason, "no CUDA device found (driver missing or no GPU)");
    }

    #[test]
    fn nothing_usable_lists_everything_tried() {
        let e = resolve(&s(&["rocm", "metal"]), &[Dtype::F32], &Inventory::cpu_only(2)).unwrap_err();
        assert_eq!(e.tried.len(), 2);
        assert!(e.to_string().starts_with("no preferred device is usable: rocm: candle has no ROCm"));
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
}
