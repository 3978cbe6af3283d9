//! Vulkan devices as the loader reports them: name, vendor, kind, driver, device-local memory
//! and the compute features the GPU engine needs (buffer device addresses, 64-bit integers,
//! 16-bit storage for bf16/f16) or could use (bfloat16, cooperative matrices). The loader
//! (`libvulkan.so.1`, `vulkan-1.dll`, `libvulkan.dylib`; [`libraries`]) is opened at run time, so
//! a build with this feature runs on machines without Vulkan and simply finds no devices there.

use std::ffi::CStr;

use ash::vk;

use super::{VENDOR_AMD, VENDOR_APPLE, VENDOR_INTEL, VENDOR_NVIDIA};

/// What `rtune doctor` shows of a Vulkan device, and what the policy matches on.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct VulkanInfo {
    pub name: String,
    pub vendor_id: u32,
    /// `discrete`, `integrated`, `virtual`, `cpu` (a software driver such as lavapipe) or `other`.
    pub kind: &'static str,
    /// Driver name and version, e.g. `NVIDIA 580.82.07` or `llvmpipe Mesa 22.3.6`.
    pub driver: String,
    /// Vulkan version the device supports, e.g. `1.3`.
    pub api: String,
    /// Memory for tensors: the largest device-local heap (on an integrated GPU, or the largest
    /// other heap if that is larger; see [`tensor_memory_bytes`]).
    pub memory_bytes: u64,
    /// What the driver says this process may still allocate of that ([`TensorMemory::free`]).
    pub memory_free_bytes: Option<u64>,
    /// 16-bit storage buffers: bf16 and f16 tensors (the kernels compute in f32, so neither
    /// `shaderFloat16` nor `VK_KHR_shader_bfloat16` is needed).
    pub storage16: bool,
    /// `VK_KHR_shader_bfloat16` (native bf16 arithmetic; the engine does not need it).
    pub bf16: bool,
    /// `VK_KHR_cooperative_matrix`: tensor-core / matrix-core GEMMs from shaders.
    pub cooperative_matrix: bool,
    /// The products the device runs on its matrix units that the engine's GEMM can use
    /// ([`matrix_units`]); empty where there are none.
    pub matrix_shapes: Vec<MatrixShape>,
    /// Where the device lists cooperative matrices but lacks features the engine's kernels on
    /// them need, those features.
    pub matrix_missing: Vec<&'static str>,
    /// Invocations per subgroup (a warp, a wavefront; the SIMD width of a CPU implementation),
    /// and where the device can run others (`VK_EXT_subgroup_size_control`), the range.
    pub subgroup: u32,
    pub subgroup_range: Option<(u32, u32)>,
    /// Compute units (SMs, CUs, shader cores) where the driver says ([`compute_units`]).
    pub compute_units: Option<u32>,
    /// The largest single allocation ([`max_allocation`]).
    pub max_allocation_bytes: u64,
    /// Features the GPU engine needs that the device lacks (Vulkan 1.2, buffer device
    /// addresses, 64-bit integers); empty when it can train here.
    pub missing: Vec<&'static str>,
}

impl VulkanInfo {
    pub fn vendor(&self) -> &'static str {
        match self.vendor_id {
            VENDOR_AMD => "AMD",
            VENDOR_INTEL => "Intel",
            VENDOR_NVIDIA => "NVIDIA",
            VENDOR_APPLE => "Apple",
            0x13b5 => "ARM",
            0x5143 => "Qualcomm",
            0x10005 => "Mesa",
            _ => "unknown vendor",
        }
    }

    /// A hardware GPU (not a software rasteriser running on the CPU).
    pub fn is_gpu(&self) -> bool {
        matches!(self.kind, "discrete" | "integrated" | "virtual")
    }
}

/// A product a device runs on its matrix units (tensor cores, AMD's WMMA, Intel's XMX) through
/// `VK_KHR_cooperative_matrix`: an `m × k` by `k × n` tile in `ab` (`f16` or `bf16`) accumulated
/// in f32 by one subgroup — the forms the engine's `gemm_cm` kernel is built for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct MatrixShape {
    pub m: u32,
    pub n: u32,
    pub k: u32,
    pub ab: &'static str,
}

impl std::fmt::Display for MatrixShape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}×{}×{}", self.ab, self.m, self.n, self.k)
    }
}

/// `VK_COMPONENT_TYPE_BFLOAT16_KHR` (`VK_KHR_shader_bfloat16`, newer than `ash`'s headers).
const COMPONENT_BF16: vk::ComponentTypeKHR = vk::ComponentTypeKHR::from_raw(1_000_141_000);

/// `VkPhysicalDeviceShaderBfloat16FeaturesKHR` (`VK_KHR_shader_bfloat16`, newer than `ash`'s
/// headers): queried with the device's features, and chained into device creation to enable
/// bf16 cooperative matrices.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Bf16Features {
    pub s_type: vk::StructureType,
    pub p_next: *mut std::ffi::c_void,
    pub shader_bfloat16_type: vk::Bool32,
    pub shader_bfloat16_dot_product: vk::Bool32,
    pub shader_bfloat16_cooperative_matrix: vk::Bool32,
}

impl Default for Bf16Features {
    fn default() -> Self {
        Bf16Features {
            s_type: vk::StructureType::from_raw(1_000_141_000),
            p_next: std::ptr::null_mut(),
            shader_bfloat16_type: vk::FALSE,
            shader_bfloat16_dot_product: vk::FALSE,
            shader_bfloat16_cooperative_matrix: vk::FALSE,
        }
    }
}

// SAFETY: the layout of VkPhysicalDeviceShaderBfloat16FeaturesKHR (sType, pNext, three
// VkBool32), which extends both structures in the Vulkan registry.
unsafe impl vk::ExtendsPhysicalDeviceFeatures2 for Bf16Features {}
// SAFETY: as above.
unsafe impl vk::ExtendsDeviceCreateInfo for Bf16Features {}

/// The matrix-unit products of device `pd` that the engine's cooperative-matrix GEMM can run:
/// subgroup scope, f16 or bf16 inputs, f32 accumulator and result, not saturating. The kernel
/// needs `shaderFloat16` and `vulkanMemoryModel`, and bf16 `shaderBFloat16Type` and
/// `shaderBFloat16CooperativeMatrix`, which the engine enables; and, which the spec asks of any
/// device running them, `vulkanMemoryModelDeviceScope` (once the memory model is enabled, the
/// engine's other kernels' `memoryBarrierShared()`, Device scope in SPIR-V, need it:
/// VUID-RuntimeSpirv-vulkanMemoryModel-06265) and `VK_EXT_subgroup_size_control`'s
/// `computeFullSubgroups` (a pipeline with cooperative-matrix instructions from SPIR-V before 1.6
/// must require full subgroups: VUID-RuntimeSpirv-OpTypeCooperativeMatrixKHR-10770; the
/// extension, not Vulkan 1.3's core, since the instance asks for Vulkan 1.2). Empty without
/// `VK_KHR_cooperative_matrix` or those features, which [`MatrixUnits::missing`] then names.
///
/// # Safety
/// `pd` must be a physical device of the live `instance`, created from `entry`.
pub unsafe fn matrix_units(entry: &ash::Entry, instance: &ash::Instance, pd: vk::PhysicalDevice) -> MatrixUnits {
    // SAFETY (all calls): the caller's contract; chained structures outlive the calls.
    if !unsafe { has_extension(instance, pd, ash::khr::cooperative_matrix::NAME) } {
        return MatrixUnits::default();
    }
    let bf16_listed = unsafe { has_extension(instance, pd, c"VK_KHR_shader_bfloat16") };
    let mut cm = vk::PhysicalDeviceCooperativeMatrixFeaturesKHR::default();
    let mut f16 = vk::PhysicalDeviceShaderFloat16Int8Features::default();
    let mut model = vk::PhysicalDeviceVulkanMemoryModelFeatures::default();
    let mut bf16 = Bf16Features::default();
    let mut full = vk::PhysicalDeviceSubgroupSizeControlFeatures::default();
    let size_control = unsafe { has_extension(instance, pd, ash::ext::subgroup_size_control::NAME) };
    let mut features =
        vk::PhysicalDeviceFeatures2::default().push_next(&mut cm).push_next(&mut f16).push_next(&mut model);
    if bf16_listed {
        features = features.push_next(&mut bf16);
    }
    if size_control {
        features = features.push_next(&mut full);
    }
    unsafe { instance.get_physical_device_features2(pd, &mut features) };
    let missing: Vec<&'static str> = [
        (cm.cooperative_matrix, "cooperativeMatrix"),
        (f16.shader_float16, "shaderFloat16"),
        (model.vulkan_memory_model, "vulkanMemoryModel"),
        (model.vulkan_memory_model_device_scope, "vulkanMemoryModelDeviceScope"),
        (full.compute_full_subgroups, "computeFullSubgroups"),
    ]
    .into_iter()
    .filter(|(has, _)| *has != vk::TRUE)
    .map(|(_, name)| name)
    .collect();
    if !missing.is_empty() {
        return MatrixUnits { shapes: Vec::new(), missing };
    }
    let ext = ash::khr::cooperative_matrix::Instance::new(entry, instance);
    let props = unsafe { ext.get_physical_device_cooperative_matrix_properties(pd) }.unwrap_or_default();
    let mut shapes: Vec<MatrixShape> = props
        .iter()
        .filter(|p| {
            p.scope == vk::ScopeKHR::SUBGROUP
                && p.a_type == p.b_type
                && p.c_type == vk::ComponentTypeKHR::FLOAT32
                && p.result_type == vk::ComponentTypeKHR::FLOAT32
                && p.saturating_accumulation != vk::TRUE
        })
        .filter_map(|p| {
            let ab = if p.a_type == vk::ComponentTypeKHR::FLOAT16 {
                "f16"
            } else if p.a_type == COMPONENT_BF16
                && bf16.shader_bfloat16_type == vk::TRUE
                && bf16.shader_bfloat16_cooperative_matrix == vk::TRUE
            {
                "bf16"
            } else {
                return None;
            };
            Some(MatrixShape { m: p.m_size, n: p.n_size, k: p.k_size, ab })
        })
        .collect();
    shapes.dedup();
    MatrixUnits { shapes, missing }
}

/// What [`matrix_units`] found.
#[derive(Default)]
pub struct MatrixUnits {
    /// The products the engine's kernels can run on the device's matrix units.
    pub shapes: Vec<MatrixShape>,
    /// The features the kernels need that a device listing `VK_KHR_cooperative_matrix` lacks.
    pub missing: Vec<&'static str>,
}

/// The environment variable naming the Vulkan library to open, alone (a loader, or a driver
/// such as MoltenVK that serves the API itself).
pub const LIBRARY_VAR: &str = "RTUNE_VULKAN_LIBRARY";

/// The libraries tried for Vulkan, in order: the one `explicit` names (`RTUNE_VULKAN_LIBRARY`),
/// alone, where given; else the platform's loader by the name the system finds it under
/// (`libvulkan.so.1`, `vulkan-1.dll`, `libvulkan.dylib`). On macOS also the places a Mac keeps
/// Vulkan that the system's default search does not reach: the Vulkan SDK's loader
/// (`$VULKAN_SDK/lib`, the variable its setup script exports) and Homebrew's
/// (`/opt/homebrew/lib` on Apple silicon; `/usr/local/lib`, Homebrew's prefix on Intel Macs and
/// the SDK's system-wide install, is searched by name); then MoltenVK itself, which serves
/// the Vulkan API over Metal without a loader (Homebrew's `molten-vk` alone).
pub fn libraries(os: &str, explicit: Option<&str>, sdk: Option<&str>) -> Vec<String> {
    if let Some(lib) = explicit.filter(|l| !l.is_empty()) {
        return vec![lib.to_string()];
    }
    match os {
        "windows" => vec!["vulkan-1.dll".into()],
        "macos" => {
            let sdk = sdk.filter(|s| !s.is_empty()).map(|s| s.trim_end_matches('/'));
            let mut libs = vec!["libvulkan.dylib".to_string()];
            libs.extend(sdk.map(|s| format!("{s}/lib/libvulkan.1.dylib")));
            libs.push("/opt/homebrew/lib/libvulkan.1.dylib".into());
            libs.push("libMoltenVK.dylib".into());
            libs.extend(sdk.map(|s| format!("{s}/lib/libMoltenVK.dylib")));
            libs.push("/opt/homebrew/lib/libMoltenVK.dylib".into());
            libs
        }
        _ => vec!["libvulkan.so.1".into()],
    }
}

/// A Vulkan instance (no layers), the caller's to destroy, and the library it came from.
pub struct Opened {
    pub entry: ash::Entry,
    pub instance: ash::Instance,
    pub library: String,
}

/// Open Vulkan through the first of [`libraries`] that lists a device (or, where none does,
/// the first that opens at all: it lists none); the error names each library tried and why it
/// failed. Where a loader offers `VK_KHR_portability_enumeration`, it is enabled, so that
/// drivers layered on another API — MoltenVK on Apple's Metal — are listed too (since loader
/// 1.3.216 they are hidden otherwise).
pub fn instance() -> Result<Opened, String> {
    let explicit = std::env::var(LIBRARY_VAR).ok();
    let sdk = std::env::var("VULKAN_SDK").ok();
    let (mut tried, mut loaded) = (Vec::new(), false);
    let mut empty: Option<Opened> = None;
    for library in libraries(std::env::consts::OS, explicit.as_deref(), sdk.as_deref()) {
        let opened = match open(&library) {
            Ok(o) => o,
            Err((opens, why)) => {
                loaded |= opens;
                tried.push(format!("{library}: {why}"));
                continue;
            }
        };
        // SAFETY: a query of the live instance.
        let devices = unsafe { opened.instance.enumerate_physical_devices() }.map(|d| d.len()).unwrap_or(0);
        if devices > 0 {
            if let Some(e) = empty {
                // SAFETY: nothing was created from the instance that listed no device.
                unsafe { e.instance.destroy_instance(None) };
            }
            return Ok(opened);
        }
        match empty {
            None => empty = Some(opened),
            // SAFETY: nothing was created from this instance.
            Some(_) => unsafe { opened.instance.destroy_instance(None) },
        }
    }
    let what = if loaded { "no usable Vulkan driver" } else { "no Vulkan loader" };
    empty.ok_or_else(|| format!("{what} ({})", tried.join("; ")))
}

/// Open `library` and create an instance from it; the error says whether the library opened.
fn open(library: &str) -> Result<Opened, (bool, String)> {
    // SAFETY: opens a Vulkan library (a loader, or an implementation exporting the API's entry
    // points, as MoltenVK does); its entry points are only called through `ash`'s typed wrappers.
    let entry = unsafe { ash::Entry::load_from(library) }.map_err(|e| match e {
        // (The dynamic linker's message names the library on Linux and macOS; not again.)
        ash::LoadingError::LibraryLoadFailure(e) => {
            let text = e.to_string();
            (false, text.strip_prefix(&format!("{library}: ")).unwrap_or(&text).to_string())
        }
        other => (false, other.to_string()),
    })?;
    let portability = ash::khr::portability_enumeration::NAME;
    // SAFETY: a query of the loader with no layer named.
    let offered = unsafe { entry.enumerate_instance_extension_properties(None) }
        .unwrap_or_default()
        .iter()
        .any(|e| e.extension_name_as_c_str() == Ok(portability));
    let extensions = if offered { vec![portability.as_ptr()] } else { Vec::new() };
    let flags =
        if offered { vk::InstanceCreateFlags::ENUMERATE_PORTABILITY_KHR } else { vk::InstanceCreateFlags::empty() };
    let app = vk::ApplicationInfo::default().application_name(c"rtune").api_version(vk::API_VERSION_1_2);
    let create =
        vk::InstanceCreateInfo::default().application_info(&app).enabled_extension_names(&extensions).flags(flags);
    // SAFETY: the create info and what it points to live across the call.
    let instance =
        unsafe { entry.create_instance(&create, None) }.map_err(|e| (true, format!("vkCreateInstance failed: {e}")))?;
    Ok(Opened { entry, instance, library: library.to_string() })
}

/// Whether device `pd` lists device extension `name`.
///
/// # Safety
/// `pd` must be a physical device of the live `instance`.
pub unsafe fn has_extension(instance: &ash::Instance, pd: vk::PhysicalDevice, name: &CStr) -> bool {
    // SAFETY: the caller's contract.
    unsafe { instance.enumerate_device_extension_properties(pd) }
        .unwrap_or_default()
        .iter()
        .any(|e| e.extension_name_as_c_str() == Ok(name))
}

/// A device's subgroups (warps, wavefronts; a CPU implementation's SIMD vectors).
pub struct Subgroups {
    /// Invocations per subgroup, as compute shaders run them unless a pipeline requires another.
    pub size: u32,
    /// Where the device can run several sizes (subgroup size control: Vulkan 1.3, or
    /// `VK_EXT_subgroup_size_control`), the smallest and largest.
    pub range: Option<(u32, u32)>,
    /// The stages and operations subgroups support.
    pub stages: vk::ShaderStageFlags,
    pub operations: vk::SubgroupFeatureFlags,
}

/// # Safety
/// `pd` must be a physical device of the live `instance`.
pub unsafe fn subgroups(instance: &ash::Instance, pd: vk::PhysicalDevice) -> Subgroups {
    // SAFETY (all calls): the caller's contract; the chained structures outlive the call.
    let api = unsafe { instance.get_physical_device_properties(pd) }.api_version;
    let size_control = vk::api_version_minor(api) >= 3
        || unsafe { has_extension(instance, pd, ash::ext::subgroup_size_control::NAME) };
    let mut sub = vk::PhysicalDeviceSubgroupProperties::default();
    let mut sizes = vk::PhysicalDeviceSubgroupSizeControlProperties::default();
    let mut props2 = vk::PhysicalDeviceProperties2::default().push_next(&mut sub);
    if size_control {
        props2 = props2.push_next(&mut sizes);
    }
    unsafe { instance.get_physical_device_properties2(pd, &mut props2) };
    Subgroups {
        size: sub.subgroup_size,
        range: (size_control && sizes.min_subgroup_size < sizes.max_subgroup_size)
            .then_some((sizes.min_subgroup_size, sizes.max_subgroup_size)),
        stages: sub.supported_stages,
        operations: sub.supported_operations,
    }
}

/// The device's compute units — NVIDIA's SMs, AMD's compute units, Arm's shader cores — where the
/// driver says (`VK_NV_shader_sm_builtins`, `VK_AMD_shader_core_properties`/`2`,
/// `VK_ARM_shader_core_builtins`); `None` elsewhere (Intel, Apple, lavapipe). The engine sizes
/// its product tiles by it.
///
/// # Safety
/// `pd` must be a physical device of the live `instance`.
pub unsafe fn compute_units(instance: &ash::Instance, pd: vk::PhysicalDevice) -> Option<u32> {
    // SAFETY (all calls): the caller's contract; the chained structures outlive the call.
    let has = |name: &CStr| unsafe { has_extension(instance, pd, name) };
    let (nv, amd, amd2, arm) = (
        has(ash::nv::shader_sm_builtins::NAME),
        has(ash::amd::shader_core_properties::NAME),
        has(ash::amd::shader_core_properties2::NAME),
        has(ash::arm::shader_core_builtins::NAME),
    );
    let mut sm = vk::PhysicalDeviceShaderSMBuiltinsPropertiesNV::default();
    let mut cu = vk::PhysicalDeviceShaderCorePropertiesAMD::default();
    let mut cu2 = vk::PhysicalDeviceShaderCoreProperties2AMD::default();
    let mut cores = vk::PhysicalDeviceShaderCoreBuiltinsPropertiesARM::default();
    let mut props2 = vk::PhysicalDeviceProperties2::default();
    if nv {
        props2 = props2.push_next(&mut sm);
    }
    if amd {
        props2 = props2.push_next(&mut cu);
    }
    if amd2 {
        props2 = props2.push_next(&mut cu2);
    }
    if arm {
        props2 = props2.push_next(&mut cores);
    }
    if !(nv || amd || amd2 || arm) {
        return None;
    }
    unsafe { instance.get_physical_device_properties2(pd, &mut props2) };
    let amd_total = cu.shader_engine_count * cu.shader_arrays_per_engine_count * cu.compute_units_per_shader_array;
    [sm.shader_sm_count, cu2.active_compute_unit_count, amd_total, cores.shader_core_count].into_iter().find(|&n| n > 0)
}

/// The largest single allocation the device allows: `maxMemoryAllocationSize`, and
/// `maxBufferSize` on Vulkan 1.3 (some drivers cap both at 4 GiB, below their memory).
///
/// # Safety
/// `pd` must be a physical device of the live `instance`.
pub unsafe fn max_allocation(instance: &ash::Instance, pd: vk::PhysicalDevice) -> u64 {
    // SAFETY (both calls): the caller's contract; the chained structures outlive the call.
    let api = unsafe { instance.get_physical_device_properties(pd) }.api_version;
    let v13 = vk::api_version_minor(api) >= 3;
    let mut m3 = vk::PhysicalDeviceMaintenance3Properties::default();
    let mut m4 = vk::PhysicalDeviceMaintenance4Properties::default();
    let mut props2 = vk::PhysicalDeviceProperties2::default().push_next(&mut m3);
    if v13 {
        props2 = props2.push_next(&mut m4);
    }
    unsafe { instance.get_physical_device_properties2(pd, &mut props2) };
    let buffer = if v13 { m4.max_buffer_size } else { u64::MAX };
    m3.max_memory_allocation_size.min(buffer)
}

/// The Vulkan devices of this machine and the library that listed them ([`instance`]), or why
/// there are none (no loader, no driver).
pub fn devices() -> Result<(Vec<VulkanInfo>, String), String> {
    let Opened { entry, instance, library } = instance()?;
    // SAFETY: `instance` is live until `destroy_instance`, and every handle used comes from it.
    let found = unsafe { instance.enumerate_physical_devices() }
        .map_err(|e| format!("cannot list Vulkan devices ({e})"))
        .map(|pds| pds.into_iter().map(|pd| unsafe { describe(&entry, &instance, pd) }).collect());
    // SAFETY: nothing created from the instance outlives this call.
    unsafe { instance.destroy_instance(None) };
    found.map(|f| (f, library))
}

/// # Safety
/// `pd` must be a physical device of the live `instance`, created from `entry`.
unsafe fn describe(entry: &ash::Entry, instance: &ash::Instance, pd: vk::PhysicalDevice) -> VulkanInfo {
    let text = |c: Result<&CStr, _>| c.map(|c: &CStr| c.to_string_lossy().into_owned()).unwrap_or_default();
    // SAFETY (all calls): `pd` belongs to `instance` (the caller's contract); the out-structures
    // are chained through `push_next` and live across the call that fills them.
    let props = unsafe { instance.get_physical_device_properties(pd) };
    let api = props.api_version;
    let extensions: Vec<String> = unsafe { instance.enumerate_device_extension_properties(pd) }
        .unwrap_or_default()
        .iter()
        .map(|e| text(e.extension_name_as_c_str()))
        .collect();
    let has = |name: &str| extensions.iter().any(|e| e == name);
    let mut driver = vk::PhysicalDeviceDriverProperties::default();
    let mut props2 = vk::PhysicalDeviceProperties2::default();
    let driver_known = vk::api_version_minor(api) >= 2 || has("VK_KHR_driver_properties");
    if driver_known {
        props2 = props2.push_next(&mut driver);
    }
    unsafe { instance.get_physical_device_properties2(pd, &mut props2) };
    let driver = if driver_known {
        format!("{} {}", text(driver.driver_name_as_c_str()), text(driver.driver_info_as_c_str())).trim().to_string()
    } else {
        format!("driver version {:#x}", props.driver_version)
    };
    let support = unsafe { engine_support(instance, pd) };
    let memory = unsafe { TensorMemory::read(instance, pd, &props) };
    let subgroups = unsafe { subgroups(instance, pd) };
    let units = unsafe { matrix_units(entry, instance, pd) };
    VulkanInfo {
        name: text(props.device_name_as_c_str()),
        vendor_id: props.vendor_id,
        kind: match props.device_type {
            vk::PhysicalDeviceType::DISCRETE_GPU => "discrete",
            vk::PhysicalDeviceType::INTEGRATED_GPU => "integrated",
            vk::PhysicalDeviceType::VIRTUAL_GPU => "virtual",
            vk::PhysicalDeviceType::CPU => "cpu",
            _ => "other",
        },
        driver,
        api: format!("{}.{}", vk::api_version_major(api), vk::api_version_minor(api)),
        memory_bytes: memory.total,
        memory_free_bytes: unsafe { memory.free(instance, pd) },
        storage16: support.storage16,
        bf16: has("VK_KHR_shader_bfloat16"),
        cooperative_matrix: has("VK_KHR_cooperative_matrix"),
        matrix_shapes: units.shapes,
        matrix_missing: units.missing,
        missing: support.missing,
        subgroup: subgroups.size,
        subgroup_range: subgroups.range,
        compute_units: unsafe { compute_units(instance, pd) },
        max_allocation_bytes: unsafe { max_allocation(instance, pd) },
    }
}

/// What the GPU engine needs of a Vulkan device and what it can use there.
pub struct EngineSupport {
    /// Required features the device lacks (empty: the engine runs there).
    pub missing: Vec<&'static str>,
    /// 16-bit storage buffers (bf16 and f16 tensors).
    pub storage16: bool,
}

/// # Safety
/// `pd` must be a physical device of the live `instance`.
pub unsafe fn engine_support(instance: &ash::Instance, pd: vk::PhysicalDevice) -> EngineSupport {
    // SAFETY (both calls): the caller's contract; the chained structures outlive the call.
    let api = unsafe { instance.get_physical_device_properties(pd) }.api_version;
    let v12 = vk::api_version_major(api) > 1 || vk::api_version_minor(api) >= 2;
    let mut storage16 = vk::PhysicalDevice16BitStorageFeatures::default();
    let mut bda = vk::PhysicalDeviceBufferDeviceAddressFeatures::default();
    let mut features = vk::PhysicalDeviceFeatures2::default().push_next(&mut storage16);
    if v12 {
        features = features.push_next(&mut bda);
    }
    unsafe { instance.get_physical_device_features2(pd, &mut features) };
    let base = features.features;
    let mut missing = Vec::new();
    if !v12 {
        missing.push("Vulkan 1.2");
    }
    if bda.buffer_device_address != vk::TRUE {
        missing.push("bufferDeviceAddress");
    }
    if base.shader_int64 != vk::TRUE {
        missing.push("shaderInt64");
    }
    EngineSupport { missing, storage16: storage16.storage_buffer16_bit_access == vk::TRUE }
}

/// The memory the GPU engine may fill with tensors: the largest device-local heap, and on an
/// integrated GPU — whose heaps are all system memory — the larger of that and the largest other
/// heap. AMD's APUs keep a small carve-out device-local (often 512 MiB) and the rest of the GPU's
/// memory in a second heap, which the engine spills to (see [`tensor_memory_types`]); the two
/// are not summed, since a large carve-out and the second heap share the same RAM.
pub fn tensor_memory_bytes(memory: &vk::PhysicalDeviceMemoryProperties, integrated: bool) -> u64 {
    tensor_heaps(memory, integrated).map(|i| memory.memory_heaps[i].size).max().unwrap_or(0)
}

/// The heaps tensors live in: the largest device-local heap, and on an integrated GPU the
/// largest other heap too.
fn tensor_heaps(memory: &vk::PhysicalDeviceMemoryProperties, integrated: bool) -> impl Iterator<Item = usize> {
    let heaps = &memory.memory_heaps[..memory.memory_heap_count as usize];
    let largest = |local: bool| {
        (0..heaps.len())
            .filter(|&i| heaps[i].flags.contains(vk::MemoryHeapFlags::DEVICE_LOCAL) == local)
            .max_by_key(|&i| heaps[i].size)
    };
    largest(true).into_iter().chain(largest(false).filter(|_| integrated))
}

/// The memory the GPU engine's tensors use on a device, read once: what discovery shows and
/// what the engine budgets come from the same place.
pub struct TensorMemory {
    /// The device's memory heaps and types.
    pub properties: vk::PhysicalDeviceMemoryProperties,
    /// An integrated GPU: tensors may spill from the device-local heap to the others.
    pub integrated: bool,
    /// Bytes for tensors ([`tensor_memory_bytes`]).
    pub total: u64,
    /// The driver reports memory budgets (`VK_EXT_memory_budget`).
    budget: bool,
}

impl TensorMemory {
    /// `props`: the device's properties, which the caller has read already.
    ///
    /// # Safety
    /// `pd` must be a physical device of the live `instance`.
    pub unsafe fn read(
        instance: &ash::Instance,
        pd: vk::PhysicalDevice,
        props: &vk::PhysicalDeviceProperties,
    ) -> TensorMemory {
        let integrated = props.device_type == vk::PhysicalDeviceType::INTEGRATED_GPU;
        // SAFETY (both calls): the caller's contract.
        let properties = unsafe { instance.get_physical_device_memory_properties(pd) };
        TensorMemory {
            properties,
            integrated,
            total: tensor_memory_bytes(&properties, integrated),
            budget: unsafe { has_extension(instance, pd, ash::ext::memory_budget::NAME) },
        }
    }

    /// Of `total`, what the driver says this process may still allocate now (a heap's budget
    /// less its usage, which counts this process's own allocations): less than the heap where
    /// other programs hold memory — a desktop's compositor and browser on the GPU that drives
    /// the display. None where the driver reports no budgets.
    ///
    /// # Safety
    /// `pd` must be the physical device of the live `instance` this was read from.
    pub unsafe fn free(&self, instance: &ash::Instance, pd: vk::PhysicalDevice) -> Option<u64> {
        if !self.budget {
            return None;
        }
        let mut budget = vk::PhysicalDeviceMemoryBudgetPropertiesEXT::default();
        let mut props = vk::PhysicalDeviceMemoryProperties2::default().push_next(&mut budget);
        // SAFETY: the caller's contract; the chained structure outlives the call.
        unsafe { instance.get_physical_device_memory_properties2(pd, &mut props) };
        Some(free_in_budget(&props.memory_properties, &budget.heap_budget, &budget.heap_usage, self.integrated))
    }
}

/// The tensor heaps' budget less usage, the larger where there are two (as for their sizes).
fn free_in_budget(memory: &vk::PhysicalDeviceMemoryProperties, budget: &[u64], usage: &[u64], integrated: bool) -> u64 {
    tensor_heaps(memory, integrated).map(|i| budget[i].saturating_sub(usage[i])).max().unwrap_or(0)
}

/// The memory types (indices) a tensor buffer may live in, among `bits` (its requirements), in
/// order of preference: device-local types; on an integrated GPU then the types of other heaps
/// (uncached ones first: the GPU reads them without snooping the CPU's caches), where tensors go
/// once the device-local heap is full.
pub fn tensor_memory_types(memory: &vk::PhysicalDeviceMemoryProperties, bits: u32, integrated: bool) -> Vec<u32> {
    let types = &memory.memory_types[..memory.memory_type_count as usize];
    let allowed = |i: &u32| bits & (1 << i) != 0;
    let local = |i: u32| types[i as usize].property_flags.contains(vk::MemoryPropertyFlags::DEVICE_LOCAL);
    let cached = |i: u32| types[i as usize].property_flags.contains(vk::MemoryPropertyFlags::HOST_CACHED);
    let mut order: Vec<u32> = (0..types.len() as u32).filter(allowed).filter(|&i| local(i)).collect();
    if integrated {
        let mut other: Vec<u32> = (0..types.len() as u32).filter(allowed).filter(|&i| !local(i)).collect();
        other.sort_by_key(|&i| cached(i));
        order.extend(other);
    }
    order
}

#[cfg(test)]
mod tests {
    use super::*;

    fn memory(heaps: &[(u64, bool)], types: &[(u32, vk::MemoryPropertyFlags)]) -> vk::PhysicalDeviceMemoryProperties {
        let mut m = vk::PhysicalDeviceMemoryProperties {
            memory_heap_count: heaps.len() as u32,
            memory_type_count: types.len() as u32,
            ..Default::default()
        };
        for (i, &(size, local)) in heaps.iter().enumerate() {
            let flags = if local { vk::MemoryHeapFlags::DEVICE_LOCAL } else { vk::MemoryHeapFlags::empty() };
            m.memory_heaps[i] = vk::MemoryHeap { size, flags };
        }
        for (i, &(heap_index, property_flags)) in types.iter().enumerate() {
            m.memory_types[i] = vk::MemoryType { property_flags, heap_index };
        }
        m
    }

    #[test]
    fn integrated_gpus_spill_tensors_to_their_second_heap() {
        const GIB: u64 = 1 << 30;
        let (dl, hv, hc, hk) = (
            vk::MemoryPropertyFlags::DEVICE_LOCAL,
            vk::MemoryPropertyFlags::HOST_VISIBLE,
            vk::MemoryPropertyFlags::HOST_COHERENT,
            vk::MemoryPropertyFlags::HOST_CACHED,
        );
        // An AMD APU as RADV lists it: a 512 MiB carve-out, 7.5 GiB of GTT; cached GTT first.
        let apu = memory(
            &[(GIB / 2, true), (15 * GIB / 2, false)],
            &[(1, hv | hc | hk), (0, dl), (1, hv | hc), (0, dl | hv | hc)],
        );
        assert_eq!(tensor_memory_bytes(&apu, true), 15 * GIB / 2);
        assert_eq!(tensor_memory_types(&apu, 0b1111, true), [1, 3, 2, 0]);
        assert_eq!(tensor_memory_types(&apu, 0b0101, true), [2, 0], "only the types the buffer allows");
        // The same layout on a discrete GPU (VRAM, and system memory it reaches over PCIe):
        // tensors stay in VRAM.
        assert_eq!(tensor_memory_bytes(&apu, false), GIB / 2);
        assert_eq!(tensor_memory_types(&apu, 0b1111, false), [1, 3]);
        // A large carve-out is not counted twice with the heap that shares its RAM.
        let big = memory(&[(96 * GIB, true), (105 * GIB, false)], &[(0, dl), (1, hv | hc)]);
        assert_eq!(tensor_memory_bytes(&big, true), 105 * GIB);
        // One heap for everything (Intel, Apple, lavapipe).
        let unified = memory(&[(16 * GIB, true)], &[(0, dl), (0, dl | hv | hc), (0, dl | hv | hc | hk)]);
        assert_eq!(tensor_memory_bytes(&unified, true), 16 * GIB);
        assert_eq!(tensor_memory_types(&unified, 0b111, true), [0, 1, 2]);
    }

    #[test]
    fn vulkan_is_looked_for_where_each_system_keeps_it() {
        assert_eq!(libraries("linux", None, None), ["libvulkan.so.1"]);
        assert_eq!(libraries("windows", None, Some(r"C:\VulkanSDK\1.4.309.0")), ["vulkan-1.dll"]);
        // Named: that library alone, on every system; set but empty is unset.
        assert_eq!(libraries("linux", Some("/opt/vk/libvulkan.so.1"), None), ["/opt/vk/libvulkan.so.1"]);
        assert_eq!(libraries("macos", Some("/x/libMoltenVK.dylib"), Some("/sdk")), ["/x/libMoltenVK.dylib"]);
        assert_eq!(libraries("linux", Some(""), None), ["libvulkan.so.1"]);
        // A Mac: the loader by name (/usr/local/lib and DYLD paths), the SDK's and Homebrew's
        // loaders by path, then MoltenVK without a loader, by name, in the SDK and in Homebrew.
        assert_eq!(
            libraries("macos", None, Some("/Users/me/VulkanSDK/1.4.309.0/macOS/")),
            [
                "libvulkan.dylib",
                "/Users/me/VulkanSDK/1.4.309.0/macOS/lib/libvulkan.1.dylib",
                "/opt/homebrew/lib/libvulkan.1.dylib",
                "libMoltenVK.dylib",
                "/Users/me/VulkanSDK/1.4.309.0/macOS/lib/libMoltenVK.dylib",
                "/opt/homebrew/lib/libMoltenVK.dylib",
            ]
        );
        assert_eq!(
            libraries("macos", None, None),
            [
                "libvulkan.dylib",
                "/opt/homebrew/lib/libvulkan.1.dylib",
                "libMoltenVK.dylib",
                "/opt/homebrew/lib/libMoltenVK.dylib"
            ]
        );
    }

    #[test]
    fn free_memory_is_the_tensor_heaps_budget_less_usage() {
        const GIB: u64 = 1 << 30;
        let dl = vk::MemoryPropertyFlags::DEVICE_LOCAL;
        // A discrete GPU driving a desktop: 8 GiB VRAM (the compositor holds 1.5 GiB, so the
        // driver budgets 6.5 GiB; this process uses 1 GiB) and 32 GiB of system memory.
        let gpu = memory(&[(32 * GIB, false), (8 * GIB, true)], &[(1, dl)]);
        let (budget, usage) = ([30 * GIB, 13 * GIB / 2], [0, GIB]);
        assert_eq!(free_in_budget(&gpu, &budget, &usage, false), 11 * GIB / 2);
        // Over budget is nothing free, not an underflow.
        assert_eq!(free_in_budget(&gpu, &budget, &[0, 7 * GIB], false), 0);
        // An APU: the larger of what its two heaps have left.
        let apu = memory(&[(GIB / 2, true), (15 * GIB / 2, false)], &[(0, dl)]);
        assert_eq!(free_in_budget(&apu, &[GIB / 2, 6 * GIB], &[GIB / 4, GIB], true), 5 * GIB);
        assert_eq!(free_in_budget(&apu, &[GIB / 2, 6 * GIB], &[GIB / 4, GIB], false), GIB / 4);
    }
}
