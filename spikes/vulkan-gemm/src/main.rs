//! Issue 18's spike: how fast does each candidate kernel layer multiply the matrices of a LoRA
//! train step through Vulkan? One candidate per build (`--features wgsl`, `burn` or `ash`), so
//! that build time and binary size are each candidate's own.
//!
//!     vulkan-gemm [--dtype f32|f16] [--iters N] [--shapes 135m|360m|all|smoke]
//!
//! Prints the adapter (name, driver, device type) and one line per shape: milliseconds per GEMM
//! (median of N timed runs after warm-up, each ended by a device sync) and TFLOP/s; checks a
//! sample of each result against an f64 product on the host.

use std::time::Instant;

/// `C[m,n] = A[m,k] · B[k,n]`, row-major: the shapes one micro-batch of `tokens` rows meets in
/// a decoder layer's projections (forward), their input-gradient products (backward), and one
/// 8192-row chunk of the LM head.
fn shapes(which: &str) -> Vec<(&'static str, usize, usize, usize)> {
    let model = |name: &'static str, h: usize, i: usize| {
        let t = 4 * 512;
        vec![
            (name, t, h, h),    // q/o projection
            (name, t, h, i),    // gate/up
            (name, t, i, h),    // down
            (name, t, h, 8192), // an LM-head chunk
        ]
    };
    match which {
        "smoke" => vec![("smoke", 256, 128, 192)],
        "135m" => model("SmolLM2-135M", 576, 1536),
        "360m" => model("SmolLM2-360M", 960, 2560),
        _ => [model("SmolLM2-135M", 576, 1536), model("SmolLM2-360M", 960, 2560)].concat(),
    }
}

struct Args {
    dtype: String,
    iters: usize,
    shapes: String,
}

fn args() -> Args {
    let mut a = Args { dtype: "f32".into(), iters: 20, shapes: "all".into() };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let v = it.next().unwrap_or_else(|| panic!("{flag} needs a value"));
        match flag.as_str() {
            "--dtype" => a.dtype = v,
            "--iters" => a.iters = v.parse().expect("--iters N"),
            "--shapes" => a.shapes = v,
            _ => panic!("unknown flag {flag}"),
        }
    }
    a
}

/// Deterministic inputs in [-1, 1), rounded to f16 so that both dtypes multiply the same numbers.
fn input(len: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let x = (s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
            half::f16::from_f32(x).to_f32()
        })
        .collect()
}

/// Largest relative error of 64 sampled entries of `c` against f64 sums.
fn check(a: &[f32], b: &[f32], c: &[f32], m: usize, k: usize, n: usize) -> f64 {
    let mut worst = 0f64;
    for s in 0..64 {
        let (i, j) = ((s * 7919) % m, (s * 104_729) % n);
        let want: f64 = (0..k).map(|p| a[i * k + p] as f64 * b[p * n + j] as f64).sum();
        let scale: f64 = (0..k).map(|p| (a[i * k + p] as f64 * b[p * n + j] as f64).abs()).sum();
        worst = worst.max((c[i * n + j] as f64 - want).abs() / scale.max(1e-30));
    }
    worst
}

fn report(name: &str, m: usize, k: usize, n: usize, times: &mut [f64], err: f64) {
    times.sort_by(f64::total_cmp);
    let ms = times[times.len() / 2] * 1e3;
    let gflops = 2.0 * (m * k * n) as f64 / (ms * 1e-3) / 1e9;
    println!("{name:14} {m:5}x{k:5}x{n:5}  {ms:9.3} ms  {gflops:10.1} GFLOP/s  max rel err {err:.1e}");
}

fn main() {
    let a = args();
    let shapes = shapes(&a.shapes);
    #[cfg(feature = "wgsl")]
    wgsl::run(&a, &shapes);
    #[cfg(feature = "burn")]
    burn_gemm::run(&a, &shapes);
    #[cfg(feature = "ash")]
    ash_bda::run(&a, &shapes);
    #[cfg(not(any(feature = "wgsl", feature = "burn", feature = "ash")))]
    {
        let _ = (
            &a,
            &shapes,
            input as fn(usize, u64) -> Vec<f32>,
            check as fn(&[f32], &[f32], &[f32], usize, usize, usize) -> f64,
            report as fn(&str, usize, usize, usize, &mut [f64], f64),
        );
        eprintln!("build with --features wgsl, burn or ash");
    }
}

/// Candidate 3: `wgpu` on Vulkan with a hand-written, register-blocked WGSL kernel (64×64 tiles,
/// 4×4 outputs per invocation, f32). No cooperative matrices: wgpu exposes none in WGSL.
#[cfg(feature = "wgsl")]
mod wgsl {
    use super::*;
    use wgpu::util::DeviceExt;

    const SHADER: &str = r#"
struct Dims { m: u32, k: u32, n: u32, pad: u32 }
@group(0) @binding(0) var<storage, read> a: array<f32>;
@group(0) @binding(1) var<storage, read> b: array<f32>;
@group(0) @binding(2) var<storage, read_write> c: array<f32>;
@group(0) @binding(3) var<uniform> dims: Dims;

const TILE: u32 = 64u;
const KT: u32 = 16u;
var<workgroup> sa: array<f32, 1024>; // [KT][TILE], A transposed
var<workgroup> sb: array<f32, 1024>; // [KT][TILE]

@compute @workgroup_size(16, 16)
fn main(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>) {
    let row0 = wid.y * TILE;
    let col0 = wid.x * TILE;
    let tid = lid.y * 16u + lid.x;
    var acc: array<f32, 16>;
    for (var i = 0u; i < 16u; i++) { acc[i] = 0.0; }
    for (var k0 = 0u; k0 < dims.k; k0 += KT) {
        // 256 invocations load 1024 elements of each tile: 4 each.
        for (var l = 0u; l < 4u; l++) {
            let e = tid + l * 256u;
            // A tile: 64 rows × 16 k, stored transposed.
            let ar = e / KT; let ak = e % KT;
            let gr = row0 + ar; let gk = k0 + ak;
            var av = 0.0;
            if (gr < dims.m && gk < dims.k) { av = a[gr * dims.k + gk]; }
            sa[ak * TILE + ar] = av;
            // B tile: 16 k × 64 cols.
            let bk = e / TILE; let bc = e % TILE;
            let hk = k0 + bk; let hc = col0 + bc;
            var bv = 0.0;
            if (hk < dims.k && hc < dims.n) { bv = b[hk * dims.n + hc]; }
            sb[bk * TILE + bc] = bv;
        }
        workgroupBarrier();
        for (var kk = 0u; kk < KT; kk++) {
            var ra: array<f32, 4>;
            var rb: array<f32, 4>;
            for (var i = 0u; i < 4u; i++) {
                ra[i] = sa[kk * TILE + lid.y * 4u + i];
                rb[i] = sb[kk * TILE + lid.x * 4u + i];
            }
            for (var i = 0u; i < 4u; i++) {
                for (var j = 0u; j < 4u; j++) {
                    acc[i * 4u + j] = fma(ra[i], rb[j], acc[i * 4u + j]);
                }
            }
        }
        workgroupBarrier();
    }
    for (var i = 0u; i < 4u; i++) {
        for (var j = 0u; j < 4u; j++) {
            let r = row0 + lid.y * 4u + i;
            let cc = col0 + lid.x * 4u + j;
            if (r < dims.m && cc < dims.n) { c[r * dims.n + cc] = acc[i * 4u + j]; }
        }
    }
}
"#;

    pub fn run(args: &Args, shapes: &[(&str, usize, usize, usize)]) {
        assert_eq!(args.dtype, "f32", "the WGSL candidate is f32 only");
        let instance = wgpu::Instance::new(wgpu::InstanceDescriptor {
            backends: wgpu::Backends::VULKAN,
            ..wgpu::InstanceDescriptor::new_without_display_handle()
        });
        let adapter = pollster::block_on(instance.request_adapter(&wgpu::RequestAdapterOptions {
            power_preference: wgpu::PowerPreference::HighPerformance,
            ..Default::default()
        }))
        .expect("no Vulkan adapter");
        let info = adapter.get_info();
        println!("candidate: wgpu 30 + hand-written WGSL (f32)");
        println!(
            "adapter: {} | {:?} | driver {} {} | {:?}",
            info.name, info.device_type, info.driver, info.driver_info, info.backend
        );
        let limits = adapter.limits();
        let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
            label: None,
            required_features: wgpu::Features::empty(),
            required_limits: limits.clone(),
            ..Default::default()
        }))
        .expect("device");
        let module = device.create_shader_module(wgpu::ShaderModuleDescriptor {
            label: Some("gemm"),
            source: wgpu::ShaderSource::Wgsl(SHADER.into()),
        });
        let pipeline = device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
            label: Some("gemm"),
            layout: None,
            module: &module,
            entry_point: Some("main"),
            compilation_options: Default::default(),
            cache: None,
        });
        for &(name, m, k, n) in shapes {
            let (ha, hb) = (input(m * k, 1), input(k * n, 2));
            let storage = |data: &[f32]| {
                device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
                    label: None,
                    contents: bytemuck::cast_slice(data),
                    usage: wgpu::BufferUsages::STORAGE,
                })
            };
            let (ba, bb) = (storage(&ha), storage(&hb));
            let bytes = (m * n * 4) as u64;
            let bc = device.create_buffer(&wgpu::BufferDescriptor {
                label: None,
                size: bytes,
                usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC,
                mapped_at_creation: false,
            });
            let dims = device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
                label: None,
                contents: bytemuck::cast_slice(&[m as u32, k as u32, n as u32, 0]),
                usage: wgpu::BufferUsages::UNIFORM,
            });
            let group = device.create_bind_group(&wgpu::BindGroupDescriptor {
                label: None,
                layout: &pipeline.get_bind_group_layout(0),
                entries: &[
                    wgpu::BindGroupEntry { binding: 0, resource: ba.as_entire_binding() },
                    wgpu::BindGroupEntry { binding: 1, resource: bb.as_entire_binding() },
                    wgpu::BindGroupEntry { binding: 2, resource: bc.as_entire_binding() },
                    wgpu::BindGroupEntry { binding: 3, resource: dims.as_entire_binding() },
                ],
            });
            let launch = || {
                let mut enc = device.create_command_encoder(&Default::default());
                {
                    let mut pass = enc.begin_compute_pass(&Default::default());
                    pass.set_pipeline(&pipeline);
                    pass.set_bind_group(0, &group, &[]);
                    pass.dispatch_workgroups(n.div_ceil(64) as u32, m.div_ceil(64) as u32, 1);
                }
                queue.submit([enc.finish()]);
                device.poll(wgpu::PollType::wait_indefinitely()).expect("poll");
            };
            launch();
            let mut times = Vec::new();
            for _ in 0..args.iters {
                let t = Instant::now();
                launch();
                times.push(t.elapsed().as_secs_f64());
            }
            let staging = device.create_buffer(&wgpu::BufferDescriptor {
                label: None,
                size: bytes,
                usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            });
            let mut enc = device.create_command_encoder(&Default::default());
            enc.copy_buffer_to_buffer(&bc, 0, &staging, 0, bytes);
            queue.submit([enc.finish()]);
            staging.slice(..).map_async(wgpu::MapMode::Read, |r| r.expect("map"));
            device.poll(wgpu::PollType::wait_indefinitely()).expect("poll");
            let hc: Vec<f32> = bytemuck::cast_slice(&staging.slice(..).get_mapped_range().expect("mapped")).to_vec();
            report(name, m, k, n, &mut times, check(&ha, &hb, &hc, m, k, n));
        }
    }
}

/// Candidates 1 and 2: burn 0.22 on its wgpu runtime pinned to Vulkan, which compiles CubeCL
/// kernels to SPIR-V and multiplies with cubek's autotuned matmul (cooperative matrices where
/// the device has them). CubeCL used directly would launch the same kernels.
#[cfg(feature = "burn")]
mod burn_gemm {
    use super::*;
    use burn::prelude::*;
    use burn::tensor::DType;

    pub fn run(args: &Args, shapes: &[(&str, usize, usize, usize)]) {
        let device = Device::vulkan(DeviceKind::DefaultDevice);
        let dtype = match args.dtype.as_str() {
            "f16" => DType::F16,
            "bf16" => DType::BF16,
            _ => DType::F32,
        };
        println!("candidate: burn 0.22 (CubeCL SPIR-V on wgpu/Vulkan), {dtype:?}");
        println!(
            "adapter: CUBECL_WGPU_DEFAULT_DEVICE={}",
            std::env::var("CUBECL_WGPU_DEFAULT_DEVICE").unwrap_or_default()
        );
        for &(name, m, k, n) in shapes {
            let (ha, hb) = (input(m * k, 1), input(k * n, 2));
            let ta = Tensor::<2>::from_data(TensorData::new(ha.clone(), [m, k]), &device).cast(dtype);
            let tb = Tensor::<2>::from_data(TensorData::new(hb.clone(), [k, n]), &device).cast(dtype);
            // Warm-up: autotune picks a kernel for this shape on the first calls.
            for _ in 0..3 {
                let _ = ta.clone().matmul(tb.clone());
                device.sync().expect("sync");
            }
            let mut times = Vec::new();
            let mut last = None;
            for _ in 0..args.iters {
                let t = Instant::now();
                let c = ta.clone().matmul(tb.clone());
                device.sync().expect("sync");
                times.push(t.elapsed().as_secs_f64());
                last = Some(c);
            }
            let hc: Vec<f32> = last.unwrap().cast(DType::F32).into_data().to_vec().expect("f32 data");
            report(name, m, k, n, &mut times, check(&ha, &hb, &hc, m, k, n));
        }
    }
}

/// Candidate 4: `ash` (the loader only) with a GLSL kernel compiled to SPIR-V ahead of time
/// (`shaders/`), reading and writing its buffers through buffer device addresses passed as push
/// constants — the raw-pointer model of rtune's GPU engine (`Gpu` trait), on Vulkan.
#[cfg(feature = "ash")]
mod ash_bda {
    use super::*;
    use ash::vk;

    const SPV_F32: &[u8] = include_bytes!("../shaders/gemm_f32.spv");
    const SPV_F16_COOPMAT: &[u8] = include_bytes!("../shaders/gemm_f16_coopmat_nv.spv");

    struct Buffer {
        buf: vk::Buffer,
        mem: vk::DeviceMemory,
        addr: u64,
    }

    pub fn run(args: &Args, shapes: &[(&str, usize, usize, usize)]) {
        // f32: the tiled kernel; f16: tensor cores through VK_NV_cooperative_matrix.
        let coop = match args.dtype.as_str() {
            "f32" => false,
            "f16" => true,
            other => panic!("the ash candidate runs f32 or f16, not {other}"),
        };
        // SAFETY (whole function): every handle is created from the instance/device made here
        // and used on this thread only; command buffers are waited on before their buffers are
        // read or destroyed.
        unsafe {
            let entry = ash::Entry::load().expect("a Vulkan loader");
            let app = vk::ApplicationInfo::default().api_version(vk::API_VERSION_1_2);
            let instance = entry
                .create_instance(&vk::InstanceCreateInfo::default().application_info(&app), None)
                .expect("a Vulkan instance");
            let rank = |t: vk::PhysicalDeviceType| match t {
                vk::PhysicalDeviceType::DISCRETE_GPU => 3,
                vk::PhysicalDeviceType::INTEGRATED_GPU => 2,
                vk::PhysicalDeviceType::VIRTUAL_GPU => 1,
                _ => 0,
            };
            let pd = instance
                .enumerate_physical_devices()
                .expect("devices")
                .into_iter()
                .max_by_key(|&p| rank(instance.get_physical_device_properties(p).device_type))
                .expect("a Vulkan device");
            let props = instance.get_physical_device_properties(pd);
            println!(
                "candidate: ash + GLSL/SPIR-V with buffer device addresses ({})",
                if coop { "f16 inputs, f32 accumulation, VK_NV_cooperative_matrix" } else { "f32, tiled" }
            );
            println!(
                "adapter: {} | device type {} | Vulkan {}.{}",
                props.device_name_as_c_str().unwrap_or_default().to_string_lossy(),
                props.device_type.as_raw(),
                vk::api_version_major(props.api_version),
                vk::api_version_minor(props.api_version)
            );
            let qfi = instance
                .get_physical_device_queue_family_properties(pd)
                .iter()
                .position(|q| q.queue_flags.contains(vk::QueueFlags::COMPUTE))
                .expect("a compute queue") as u32;
            let prio = [1.0f32];
            let queues = [vk::DeviceQueueCreateInfo::default().queue_family_index(qfi).queue_priorities(&prio)];
            let extensions: Vec<String> = instance
                .enumerate_device_extension_properties(pd)
                .unwrap_or_default()
                .iter()
                .map(|e| e.extension_name_as_c_str().unwrap_or_default().to_string_lossy().into_owned())
                .collect();
            if coop && !extensions.iter().any(|e| e == "VK_NV_cooperative_matrix") {
                println!("skipped: the device has no VK_NV_cooperative_matrix");
                return;
            }
            let ext_names = [c"VK_NV_cooperative_matrix".as_ptr()];
            let mut v11 = vk::PhysicalDeviceVulkan11Features::default().storage_buffer16_bit_access(coop);
            let mut v12 = vk::PhysicalDeviceVulkan12Features::default()
                .buffer_device_address(true)
                .shader_float16(coop)
                .vulkan_memory_model(coop);
            let mut coop_features = vk::PhysicalDeviceCooperativeMatrixFeaturesNV::default().cooperative_matrix(true);
            let features = vk::PhysicalDeviceFeatures::default().shader_int64(true);
            let mut create = vk::DeviceCreateInfo::default()
                .queue_create_infos(&queues)
                .enabled_features(&features)
                .push_next(&mut v12)
                .push_next(&mut v11);
            if coop {
                create = create.enabled_extension_names(&ext_names).push_next(&mut coop_features);
            }
            let device = instance.create_device(pd, &create, None).expect("a device with buffer device addresses");
            let queue = device.get_device_queue(qfi, 0);
            let memory = instance.get_physical_device_memory_properties(pd);
            let alloc = |bytes: usize, want: vk::MemoryPropertyFlags| -> Buffer {
                let usage = vk::BufferUsageFlags::STORAGE_BUFFER
                    | vk::BufferUsageFlags::SHADER_DEVICE_ADDRESS
                    | vk::BufferUsageFlags::TRANSFER_SRC
                    | vk::BufferUsageFlags::TRANSFER_DST;
                let buf = device
                    .create_buffer(&vk::BufferCreateInfo::default().size(bytes as u64).usage(usage), None)
                    .unwrap();
                let req = device.get_buffer_memory_requirements(buf);
                let ty = (0..memory.memory_type_count)
                    .find(|&i| {
                        req.memory_type_bits & (1 << i) != 0
                            && memory.memory_types[i as usize].property_flags.contains(want)
                    })
                    .expect("a memory type");
                let mut flags = vk::MemoryAllocateFlagsInfo::default().flags(vk::MemoryAllocateFlags::DEVICE_ADDRESS);
                let mem = device
                    .allocate_memory(
                        &vk::MemoryAllocateInfo::default()
                            .allocation_size(req.size)
                            .memory_type_index(ty)
                            .push_next(&mut flags),
                        None,
                    )
                    .expect("device memory");
                device.bind_buffer_memory(buf, mem, 0).unwrap();
                let addr = device.get_buffer_device_address(&vk::BufferDeviceAddressInfo::default().buffer(buf));
                Buffer { buf, mem, addr }
            };
            let free = |b: Buffer| {
                device.destroy_buffer(b.buf, None);
                device.free_memory(b.mem, None);
            };
            let spv = if coop { SPV_F16_COOPMAT } else { SPV_F32 };
            let code = ash::util::read_spv(&mut std::io::Cursor::new(spv)).expect("SPIR-V");
            let module = device.create_shader_module(&vk::ShaderModuleCreateInfo::default().code(&code), None).unwrap();
            let ranges =
                [vk::PushConstantRange::default().stage_flags(vk::ShaderStageFlags::COMPUTE).offset(0).size(40)];
            let layout = device
                .create_pipeline_layout(&vk::PipelineLayoutCreateInfo::default().push_constant_ranges(&ranges), None)
                .unwrap();
            let stage = vk::PipelineShaderStageCreateInfo::default()
                .stage(vk::ShaderStageFlags::COMPUTE)
                .module(module)
                .name(c"main");
            let pipeline = device
                .create_compute_pipelines(
                    vk::PipelineCache::null(),
                    &[vk::ComputePipelineCreateInfo::default().stage(stage).layout(layout)],
                    None,
                )
                .expect("the pipeline")[0];
            let pool = device
                .create_command_pool(
                    &vk::CommandPoolCreateInfo::default()
                        .queue_family_index(qfi)
                        .flags(vk::CommandPoolCreateFlags::RESET_COMMAND_BUFFER),
                    None,
                )
                .unwrap();
            let cmd = device
                .allocate_command_buffers(
                    &vk::CommandBufferAllocateInfo::default().command_pool(pool).command_buffer_count(1),
                )
                .unwrap()[0];
            let fence = device.create_fence(&vk::FenceCreateInfo::default(), None).unwrap();
            // Record with `f`, submit, wait.
            let submit = |f: &dyn Fn()| {
                device.reset_command_buffer(cmd, vk::CommandBufferResetFlags::empty()).unwrap();
                device.begin_command_buffer(cmd, &vk::CommandBufferBeginInfo::default()).unwrap();
                f();
                device.end_command_buffer(cmd).unwrap();
                let cmds = [cmd];
                device.queue_submit(queue, &[vk::SubmitInfo::default().command_buffers(&cmds)], fence).unwrap();
                device.wait_for_fences(&[fence], true, u64::MAX).unwrap();
                device.reset_fences(&[fence]).unwrap();
            };
            let host = vk::MemoryPropertyFlags::HOST_VISIBLE | vk::MemoryPropertyFlags::HOST_COHERENT;
            let copy = |src: &Buffer, dst: &Buffer, bytes: usize| {
                submit(&|| {
                    device.cmd_copy_buffer(cmd, src.buf, dst.buf, &[vk::BufferCopy::default().size(bytes as u64)])
                })
            };
            for &(name, m, k, n) in shapes {
                let (ha, hb) = (input(m * k, 1), input(k * n, 2));
                if coop && (m % 64 != 0 || n % 64 != 0 || k % 16 != 0) {
                    println!("{name:14} {m:5}x{k:5}x{n:5}  skipped: the kernel needs m, n multiples of 64, k of 16");
                    continue;
                }
                let to_device = |data: &[f32]| {
                    let data: Vec<u8> = if coop {
                        data.iter().flat_map(|x| half::f16::from_f32(*x).to_le_bytes()).collect()
                    } else {
                        data.iter().flat_map(|x| x.to_le_bytes()).collect()
                    };
                    let bytes = data.len();
                    let staging = alloc(bytes, host);
                    let p = device.map_memory(staging.mem, 0, bytes as u64, vk::MemoryMapFlags::empty()).unwrap();
                    std::ptr::copy_nonoverlapping(data.as_ptr(), p as *mut u8, bytes);
                    device.unmap_memory(staging.mem);
                    let dev = alloc(bytes, vk::MemoryPropertyFlags::DEVICE_LOCAL);
                    copy(&staging, &dev, bytes);
                    free(staging);
                    dev
                };
                let (da, db) = (to_device(&ha), to_device(&hb));
                let dc = alloc(m * n * 4, vk::MemoryPropertyFlags::DEVICE_LOCAL);
                let mut push = Vec::with_capacity(40);
                for x in [da.addr, db.addr, dc.addr] {
                    push.extend_from_slice(&x.to_le_bytes());
                }
                for x in [m as u32, k as u32, n as u32, 0] {
                    push.extend_from_slice(&x.to_le_bytes());
                }
                let launch = || {
                    submit(&|| {
                        device.cmd_bind_pipeline(cmd, vk::PipelineBindPoint::COMPUTE, pipeline);
                        device.cmd_push_constants(cmd, layout, vk::ShaderStageFlags::COMPUTE, 0, &push);
                        // Both kernels cover a 64×64 tile per workgroup.
                        device.cmd_dispatch(cmd, n.div_ceil(64) as u32, m.div_ceil(64) as u32, 1);
                    })
                };
                launch();
                let mut times = Vec::new();
                for _ in 0..args.iters {
                    let t = Instant::now();
                    launch();
                    times.push(t.elapsed().as_secs_f64());
                }
                let staging = alloc(m * n * 4, host);
                copy(&dc, &staging, m * n * 4);
                let p = device.map_memory(staging.mem, 0, (m * n * 4) as u64, vk::MemoryMapFlags::empty()).unwrap();
                let hc = std::slice::from_raw_parts(p as *const f32, m * n).to_vec();
                device.unmap_memory(staging.mem);
                report(name, m, k, n, &mut times, check(&ha, &hb, &hc, m, k, n));
                for b in [da, db, dc, staging] {
                    free(b);
                }
            }
            device.device_wait_idle().unwrap();
            device.destroy_fence(fence, None);
            device.destroy_command_pool(pool, None);
            device.destroy_pipeline(pipeline, None);
            device.destroy_pipeline_layout(layout, None);
            device.destroy_shader_module(module, None);
            device.destroy_device(None);
            instance.destroy_instance(None);
        }
    }
}
