//! Issue 18's spike: how fast does each candidate kernel layer multiply the matrices of a LoRA
//! train step through Vulkan? One candidate per build (`--features wgsl` or `--features burn`),
//! so that build time and binary size are each candidate's own.
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
    #[cfg(not(any(feature = "wgsl", feature = "burn")))]
    {
        let _ = (
            &a,
            &shapes,
            input as fn(usize, u64) -> Vec<f32>,
            check as fn(&[f32], &[f32], &[f32], usize, usize, usize) -> f64,
            report as fn(&str, usize, usize, usize, &mut [f64], f64),
        );
        eprintln!("build with --features wgsl or --features burn");
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
