//! The `RTUNE_*` switches that steer engines, read from the environment once per process into
//! one value ([`Switches::get`]). Engine code reads them from here, never from the environment;
//! those that change a stage's numbers go into the keys of the stages they affect
//! ([`Switches::engine`] and [`Switches::kernels`], read by the plan), so a run under another
//! switch never reuses an artifact computed without it.
//!
//! | switch | what it does | in the key |
//! |---|---|---|
//! | `RTUNE_ENGINE` | `candle`, `fused` or `gpu`: the engine to run (to compare engines) | train, evaluate, quantize |
//! | `RTUNE_GPU_ATTENTION` | `scalar` or `products`: attention kernels on CUDA/Vulkan | same, on GPU devices |
//! | `RTUNE_VULKAN_GEMM_TILE` | `64x64` … `32x32`: the product tile on Vulkan | same, on Vulkan |
//! | `RTUNE_VULKAN_GPU_KERNELS` | `1`: the kernels written for GPUs on a CPU Vulkan device | same, on Vulkan |
//! | `RTUNE_VULKAN_ROLL_LOOPS` | `1`: matrix-unit kernels compiled with their loops rolled (the same programs) | no |
//! | `RTUNE_PROFILE` | a step-time breakdown; `kernels`: per-kernel times on Vulkan too | no |

use std::sync::OnceLock;

use crate::device::DeviceClass;

/// The engine switches of this process.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Switches {
    /// `RTUNE_ENGINE` (`auto` and empty are none).
    pub engine: Option<String>,
    /// `RTUNE_GPU_ATTENTION`.
    pub gpu_attention: Option<String>,
    /// `RTUNE_VULKAN_GEMM_TILE`.
    pub vulkan_gemm_tile: Option<String>,
    /// `RTUNE_VULKAN_GPU_KERNELS=1`.
    pub vulkan_gpu_kernels: bool,
    /// `RTUNE_VULKAN_ROLL_LOOPS=1`.
    pub vulkan_roll_loops: bool,
    /// `RTUNE_PROFILE` (any value; `kernels` also times each Vulkan kernel).
    pub profile: Option<String>,
}

impl Switches {
    /// The switches `var` gives (the environment's, in [`Switches::get`]).
    pub fn read(var: impl Fn(&str) -> Option<String>) -> Switches {
        let set = |name: &str| var(name).filter(|v| !v.is_empty());
        Switches {
            engine: set("RTUNE_ENGINE").filter(|e| e != "auto"),
            gpu_attention: set("RTUNE_GPU_ATTENTION"),
            vulkan_gemm_tile: set("RTUNE_VULKAN_GEMM_TILE"),
            vulkan_gpu_kernels: set("RTUNE_VULKAN_GPU_KERNELS").is_some_and(|v| v == "1"),
            vulkan_roll_loops: set("RTUNE_VULKAN_ROLL_LOOPS").is_some_and(|v| v == "1"),
            profile: set("RTUNE_PROFILE"),
        }
    }

    /// This process's switches, read from the environment the first time.
    pub fn get() -> &'static Switches {
        static SWITCHES: OnceLock<Switches> = OnceLock::new();
        SWITCHES.get_or_init(|| Switches::read(|name| std::env::var(name).ok()))
    }

    /// The switches set that change what the kernels on a `class` device compute, as
    /// `NAME=value`, in a fixed order (empty where none do).
    pub fn kernels(&self, class: DeviceClass) -> Vec<String> {
        let gpu = matches!(class, DeviceClass::Cuda | DeviceClass::Vulkan);
        let vulkan = class == DeviceClass::Vulkan;
        let mut out = Vec::new();
        if let Some(a) = self.gpu_attention.as_ref().filter(|_| gpu) {
            out.push(format!("RTUNE_GPU_ATTENTION={a}"));
        }
        if let Some(t) = self.vulkan_gemm_tile.as_ref().filter(|_| vulkan) {
            out.push(format!("RTUNE_VULKAN_GEMM_TILE={t}"));
        }
        if self.vulkan_gpu_kernels && vulkan {
            out.push("RTUNE_VULKAN_GPU_KERNELS=1".into());
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the environment sets is read as the engines use it, and only the switches that change
    /// a device's numbers are named for its keys.
    #[test]
    fn switches_that_change_results_are_named_for_the_devices_they_affect() {
        let env = |pairs: &'static [(&str, &str)]| {
            Switches::read(move |name| pairs.iter().find(|(k, _)| *k == name).map(|(_, v)| v.to_string()))
        };
        assert_eq!(env(&[]), Switches::default());
        assert_eq!(env(&[("RTUNE_ENGINE", "auto")]).engine, None);
        assert_eq!(env(&[("RTUNE_ENGINE", "")]).engine, None);
        let s = env(&[
            ("RTUNE_ENGINE", "gpu"),
            ("RTUNE_GPU_ATTENTION", "scalar"),
            ("RTUNE_VULKAN_GEMM_TILE", "32x64"),
            ("RTUNE_VULKAN_GPU_KERNELS", "1"),
            ("RTUNE_VULKAN_ROLL_LOOPS", "1"),
            ("RTUNE_PROFILE", "kernels"),
        ]);
        assert_eq!(s.engine.as_deref(), Some("gpu"));
        assert!(s.vulkan_roll_loops && s.profile.as_deref() == Some("kernels"));
        assert!(s.kernels(DeviceClass::Cpu).is_empty(), "no switch changes the CPU's numbers");
        assert_eq!(s.kernels(DeviceClass::Cuda), ["RTUNE_GPU_ATTENTION=scalar"]);
        assert_eq!(
            s.kernels(DeviceClass::Vulkan),
            ["RTUNE_GPU_ATTENTION=scalar", "RTUNE_VULKAN_GEMM_TILE=32x64", "RTUNE_VULKAN_GPU_KERNELS=1"]
        );
        assert!(!env(&[("RTUNE_VULKAN_GPU_KERNELS", "0")]).vulkan_gpu_kernels);
    }
}
