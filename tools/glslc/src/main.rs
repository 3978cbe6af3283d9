//! `rtune-glslc -D<NAME>... -o <out.spv> <in.comp>`: compiles one compute shader for Vulkan 1.2
//! (SPIR-V 1.5) with the glslang this crate pins, so that the checked-in SPIR-V of the Vulkan
//! engine comes out byte for byte the same wherever scripts/toolchain/build-spirv.sh runs. It builds every
//! kernel, including those that need newer GLSL extensions than Debian 12's glslangValidator
//! knows (`GL_KHR_cooperative_matrix`, `GL_EXT_bfloat16`).

use std::process::ExitCode;

use glslang::{
    Compiler, CompilerOptions, ShaderInput, ShaderSource, ShaderStage, SourceLanguage, SpirvVersion, Target,
    VulkanVersion,
};

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("rtune-glslc: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<(), String> {
    let (mut defines, mut out, mut input) = (Vec::new(), None, None);
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        if let Some(d) = a.strip_prefix("-D") {
            let (name, value) = match d.split_once('=') {
                Some((n, v)) => (n.to_string(), Some(v.to_string())),
                None => (d.to_string(), None),
            };
            defines.push((name, value));
        } else if a == "-o" {
            out = args.next();
        } else if a.starts_with('-') {
            return Err(format!("unknown option {a}"));
        } else {
            input = Some(a);
        }
    }
    let (Some(out), Some(input)) = (out, input) else {
        return Err("usage: rtune-glslc -D<NAME>[=<value>]... -o <out.spv> <in.comp>".into());
    };
    let text = std::fs::read_to_string(&input).map_err(|e| format!("{input}: {e}"))?;
    let source = ShaderSource::from(text);
    let options = CompilerOptions {
        source_language: SourceLanguage::GLSL,
        target: Target::Vulkan { version: VulkanVersion::Vulkan1_2, spirv_version: SpirvVersion::SPIRV1_5 },
        ..CompilerOptions::default()
    };
    let defines: Vec<(&str, Option<&str>)> = defines.iter().map(|(n, v)| (n.as_str(), v.as_deref())).collect();
    let compiler = Compiler::acquire().ok_or("glslang did not initialise")?;
    let shader_input = ShaderInput::new(&source, ShaderStage::Compute, &options, Some(&defines), None)
        .map_err(|e| format!("{input}: {e}"))?;
    let shader = compiler.create_shader(shader_input).map_err(|e| format!("{input}: {e}"))?;
    let words = shader.compile().map_err(|e| format!("{input}: {e}"))?;
    let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
    std::fs::write(&out, bytes).map_err(|e| format!("{out}: {e}"))
}
