//! 4-bit NormalFloat (NF4) storage of frozen base weights — QLoRA (Dettmers et al. 2023), as
//! bitsandbytes stores them for `BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")`.
//!
//! A weight is flattened (row-major) and cut into blocks of [`BLOCK`] values; each block keeps
//! its largest magnitude (`absmax`, f32) and each value the index of the nearest of the 16
//! [`CODE`] values to `value / absmax`, two indices per byte (the first in the high nibble).
//! Computing with the weight dequantizes it: `CODE[index] · absmax` in f32, then rounded to the
//! compute dtype. The engines compute with exactly these values: the candle and fused CPU
//! engines hold them dequantized ([`round_trip`]), the GPU engine holds the packed form and
//! dequantizes a linear's weight just before each product that reads it.
//!
//! Which weights: every linear of the decoder layers (attention and MLP projections), as
//! transformers quantizes every `nn.Linear` but the LM head; embeddings, norms and the LM head
//! keep their precision.
//!
//! Double quantization (`"nf4-dq"`, bitsandbytes' `bnb_4bit_use_double_quant=True`): the block
//! scales, less their mean (`offset`), are quantized again, 8 bits each in blocks of
//! [`SCALE_BLOCK`] with bitsandbytes' signed dynamic code ([`dynamic_code`]) and an f32 scale per
//! block — 4.127 bits a weight instead of 4.5. A scale is then `dynamic[index] · scale2 +
//! offset`, in f32. bitsandbytes' CPU kernel picks the 8-bit index through a lookup table that
//! now and then returns a neighbour of the nearest value; rtune takes the nearest, so its scales
//! agree with bitsandbytes' to that step.

use super::{LAYER_LINEARS, ModelError, Trainable};
use crate::recipe::BaseQuant;

/// Values per block (bitsandbytes' default `blocksize` for 4-bit weights).
pub const BLOCK: usize = 64;

/// The NF4 code: quantiles of a standard normal scaled to [-1, 1], with an exact zero
/// (bitsandbytes' `get_4bit_type("nf4")`, bit for bit).
pub const CODE: [f32; 16] = [
    -1.0,
    -0.696_192_8,
    -0.525_073_05,
    -0.394_917_5,
    -0.284_441_38,
    -0.184_773_43,
    -0.091_050_036,
    0.0,
    0.079_580_3,
    0.160_930_2,
    0.246_112_3,
    0.337_915_24,
    0.440_709_83,
    0.562_617,
    0.722_956_84,
    1.0,
];

/// Block scales per block of scales under double quantization (bitsandbytes' blocksize for
/// them).
pub const SCALE_BLOCK: usize = 256;

/// bitsandbytes' `create_dynamic_map(signed=True)`, the code its 8-bit blockwise quantization
/// (of block scales, here) uses: f32 bits, ascending.
const DYNAMIC: [u32; 256] = [
    0xbf7e_3333,
    0xbf7a_999a,
    0xbf77_0000,
    0xbf73_6666,
    0xbf6f_cccd,
    0xbf6c_3333,
    0xbf68_999a,
    0xbf65_0000,
    0xbf61_6666,
    0xbf5d_cccd,
    0xbf5a_3333,
    0xbf56_999a,
    0xbf53_0000,
    0xbf4f_6666,
    0xbf4b_cccd,
    0xbf48_3333,
    0xbf44_999a,
    0xbf41_0000,
    0xbf3d_6666,
    0xbf39_cccd,
    0xbf36_3334,
    0xbf32_999a,
    0xbf2f_0000,
    0xbf2b_6666,
    0xbf27_cccd,
    0xbf24_3334,
    0xbf20_999a,
    0xbf1d_0000,
    0xbf19_6666,
    0xbf15_cccd,
    0xbf12_3334,
    0xbf0e_999a,
    0xbf0b_0000,
    0xbf07_6666,
    0xbf03_cccc,
    0xbf00_3333,
    0xbef9_3332,
    0xbef2_0000,
    0xbeea_cccc,
    0xbee3_999a,
    0xbedc_6666,
    0xbed5_3333,
    0xbece_0000,
    0xbec6_cccc,
    0xbebf_999a,
    0xbeb8_6666,
    0xbeb1_3333,
    0xbeaa_0000,
    0xbea2_cccc,
    0xbe9b_999a,
    0xbe94_6666,
    0xbe8d_3334,
    0xbe86_0000,
    0xbe7d_9999,
    0xbe6f_3333,
    0xbe60_cccd,
    0xbe52_6666,
    0xbe44_0000,
    0xbe35_999a,
    0xbe27_3333,
    0xbe18_cccd,
    0xbe0a_6666,
    0xbdf8_0000,
    0xbddb_3334,
    0xbdc9_eb85,
    0xbdc4_28f7,
    0xbdbe_6667,
    0xbdb8_a3d7,
    0xbdb2_e148,
    0xbdad_1eb8,
    0xbda7_5c2a,
    0xbda1_999a,
    0xbd9b_d70a,
    0xbd96_147b,
    0xbd90_51eb,
    0xbd8a_8f5d,
    0xbd84_cccd,
    0xbd7e_147b,
    0xbd72_8f5d,
    0xbd67_0a3d,
    0xbd5b_851f,
    0xbd50_0000,
    0xbd44_7ae1,
    0xbd38_f5c3,
    0xbd2d_70a3,
    0xbd21_eb85,
    0xbd16_6667,
    0xbd0a_e148,
    0xbcfe_b852,
    0xbce7_ae15,
    0xbcd0_a3d7,
    0xbcb9_999a,
    0xbca2_8f5d,
    0xbc8b_851f,
    0xbc68_f5c3,
    0xbc3a_e148,
    0xbc1f_3b64,
    0xbc16_0418,
    0xbc0c_cccd,
    0xbc03_9581,
    0xbbf4_bc6a,
    0xbbe2_4dd3,
    0xbbcf_df3b,
    0xbbbd_70a4,
    0xbbab_020d,
    0xbb98_9374,
    0xbb86_24dd,
    0xbb67_6c8a,
    0xbb42_8f5c,
    0xbb1d_b22d,
    0xbaf1_a9fc,
    0xbaa7_ef9d,
    0xba77_65ff,
    0xba59_e83e,
    0xba3c_6a80,
    0xba1e_ecc1,
    0xba01_6f01,
    0xb9c7_e283,
    0xb98c_e705,
    0xb923_d70b,
    0xb8ba_1f4b,
    0xb88a_efb3,
    0xb837_8034,
    0xb7b2_4206,
    0xb702_05ff,
    0xb65a_1a94,
    0xb513_a3b7,
    0x0000_0000,
    0x3513_a3b7,
    0x365a_1a94,
    0x3702_05ff,
    0x37b2_4206,
    0x3837_8034,
    0x388a_efb3,
    0x38ba_1f4b,
    0x3923_d70b,
    0x398c_e705,
    0x39c7_e283,
    0x3a01_6f01,
    0x3a1e_ecc1,
    0x3a3c_6a80,
    0x3a59_e83e,
    0x3a77_65ff,
    0x3aa7_ef9d,
    0x3af1_a9fc,
    0x3b1d_b22d,
    0x3b42_8f5c,
    0x3b67_6c8a,
    0x3b86_24dd,
    0x3b98_9374,
    0x3bab_020d,
    0x3bbd_70a4,
    0x3bcf_df3b,
    0x3be2_4dd3,
    0x3bf4_bc6a,
    0x3c03_9581,
    0x3c0c_cccd,
    0x3c16_0418,
    0x3c1f_3b64,
    0x3c3a_e148,
    0x3c68_f5c3,
    0x3c8b_851f,
    0x3ca2_8f5d,
    0x3cb9_999a,
    0x3cd0_a3d7,
    0x3ce7_ae15,
    0x3cfe_b852,
    0x3d0a_e148,
    0x3d16_6667,
    0x3d21_eb85,
    0x3d2d_70a3,
    0x3d38_f5c3,
    0x3d44_7ae1,
    0x3d50_0000,
    0x3d5b_851f,
    0x3d67_0a3d,
    0x3d72_8f5d,
    0x3d7e_147b,
    0x3d84_cccd,
    0x3d8a_8f5d,
    0x3d90_51eb,
    0x3d96_147b,
    0x3d9b_d70a,
    0x3da1_999a,
    0x3da7_5c2a,
    0x3dad_1eb8,
    0x3db2_e148,
    0x3db8_a3d7,
    0x3dbe_6667,
    0x3dc4_28f7,
    0x3dc9_eb85,
    0x3ddb_3334,
    0x3df8_0000,
    0x3e0a_6666,
    0x3e18_cccd,
    0x3e27_3333,
    0x3e35_999a,
    0x3e44_0000,
    0x3e52_6666,
    0x3e60_cccd,
    0x3e6f_3333,
    0x3e7d_9999,
    0x3e86_0000,
    0x3e8d_3334,
    0x3e94_6666,
    0x3e9b_999a,
    0x3ea2_cccc,
    0x3eaa_0000,
    0x3eb1_3333,
    0x3eb8_6666,
    0x3ebf_999a,
    0x3ec6_cccc,
    0x3ece_0000,
    0x3ed5_3333,
    0x3edc_6666,
    0x3ee3_999a,
    0x3eea_cccc,
    0x3ef2_0000,
    0x3ef9_3332,
    0x3f00_3333,
    0x3f03_cccc,
    0x3f07_6666,
    0x3f0b_0000,
    0x3f0e_999a,
    0x3f12_3334,
    0x3f15_cccd,
    0x3f19_6666,
    0x3f1d_0000,
    0x3f20_999a,
    0x3f24_3334,
    0x3f27_cccd,
    0x3f2b_6666,
    0x3f2f_0000,
    0x3f32_999a,
    0x3f36_3334,
    0x3f39_cccd,
    0x3f3d_6666,
    0x3f41_0000,
    0x3f44_999a,
    0x3f48_3333,
    0x3f4b_cccd,
    0x3f4f_6666,
    0x3f53_0000,
    0x3f56_999a,
    0x3f5a_3333,
    0x3f5d_cccd,
    0x3f61_6666,
    0x3f65_0000,
    0x3f68_999a,
    0x3f6c_3333,
    0x3f6f_cccd,
    0x3f73_6666,
    0x3f77_0000,
    0x3f7a_999a,
    0x3f7e_3333,
    0x3f80_0000,
];

/// The 8-bit code of double quantization, ascending.
pub fn dynamic_code() -> [f32; 256] {
    DYNAMIC.map(f32::from_bits)
}

/// The GPU engine's table of both codes: [`CODE`]'s 16 values, then [`dynamic_code`]'s 256.
pub fn codes() -> Vec<f32> {
    CODE.iter().copied().chain(dynamic_code()).collect()
}

/// A weight in NF4: `packed[i / 2]` holds value `i`'s code index (high nibble for even `i`);
/// `absmax[i / BLOCK]` its block's scale (as computed with: dequantized, under double
/// quantization, from `nested`).
#[derive(Debug, Clone, PartialEq)]
pub struct Nf4 {
    pub packed: Vec<u8>,
    pub absmax: Vec<f32>,
    pub len: usize,
    pub nested: Option<Nested>,
}

/// Double quantization's form of the block scales: `absmax[b] = dynamic[codes[b]] ·
/// scales[b / SCALE_BLOCK] + offset`.
#[derive(Debug, Clone, PartialEq)]
pub struct Nested {
    pub codes: Vec<u8>,
    pub scales: Vec<f32>,
    pub offset: f32,
}

/// Whether the base weight `name` is stored in NF4 when the base is quantized: the weights of
/// the decoder layers' linears.
pub fn quantizes(name: &str) -> bool {
    let Some(rest) = name.strip_prefix("model.layers.") else { return false };
    let Some((layer, rest)) = rest.split_once('.') else { return false };
    layer.bytes().all(|b| b.is_ascii_digit())
        && rest.strip_suffix(".weight").is_some_and(|linear| LAYER_LINEARS.contains(&linear))
}

/// How the base weight `name` is stored under `quant`: in 4 bits (`quant`) for a decoder
/// linear's, else as it is (None); an error when it also trains in full (a 4-bit weight has no
/// gradient to follow).
pub fn stored(quant: Option<BaseQuant>, trainable: &Trainable, name: &str) -> Result<Option<BaseQuant>, ModelError> {
    let stored = quant.filter(|_| quantizes(name));
    if stored.is_some() && trainable.trains_weight(name) {
        return Err(ModelError::Unsupported {
            what: format!(
                "training `{name}` in full while `adapter.quantize_base` keeps it in 4 bits \
                 (name only norms, biases, the embedding or the LM head beside the adapter)"
            ),
        });
    }
    Ok(stored)
}

/// Bytes the decoder layers' linear weights take at `dtype_bytes` a value, and in NF4 (packed
/// indices and block scales): what `adapter.quantize_base` saves.
pub fn linear_bytes(cfg: &super::ModelConfig, dtype_bytes: usize) -> (u64, u64) {
    let sizes = cfg.layer_linears().map(|(inp, out, _)| inp * out);
    let packed: usize = sizes.iter().map(|&n| packed_bytes(n)).sum();
    let values: usize = sizes.iter().sum();
    ((values * cfg.num_layers * dtype_bytes) as u64, (packed * cfg.num_layers) as u64)
}

/// Bytes `n` values take in NF4 without double quantization: indices and f32 block scales.
fn packed_bytes(n: usize) -> usize {
    n.div_ceil(2) + 4 * n.div_ceil(BLOCK)
}

/// The midpoints between consecutive values of an ascending code, in f32.
fn midpoints(code: &[f32]) -> Vec<f32> {
    code.windows(2).map(|p| (p[0] + p[1]) / 2.0).collect()
}

/// The index of the code value nearest to `x` (in [-1, 1]), given the code's [`midpoints`]: the
/// number of midpoints below it, a value on a midpoint going to the lower one (bitsandbytes'
/// `torch.bucketize` against the midpoints).
fn nearest(mids: &[f32], x: f32) -> u8 {
    mids.partition_point(|m| *m < x) as u8
}

/// Blockwise absmax quantization as bitsandbytes computes it: per block of `block` values the
/// largest magnitude (at least 1e-38 for a last, partial block), values scaled by its reciprocal
/// (divided by it in the partial block), clamped to [-1, 1] and given the index `index` picks.
fn blockwise(w: &[f32], block: usize, mut index: impl FnMut(usize, f32)) -> Vec<f32> {
    let mut absmax = Vec::with_capacity(w.len().div_ceil(block));
    for (b, values) in w.chunks(block).enumerate() {
        let m = values.iter().fold(0f32, |m, x| m.max(x.abs()));
        let full = values.len() == block;
        let m = if full { m } else { m.max(1e-38) };
        let inv = 1.0 / m.max(1e-38);
        absmax.push(m);
        for (j, x) in values.iter().enumerate() {
            let scaled = if full { x * inv } else { x / m };
            index(b * block + j, scaled.clamp(-1.0, 1.0));
        }
    }
    absmax
}

/// Quantize `w` (a flattened weight) as bitsandbytes does ([`blockwise`] blocks of [`BLOCK`],
/// the nearest [`CODE`] value), its scales again with `double` ([`Nested`]).
pub fn quantize(w: &[f32], double: bool) -> Nf4 {
    use rayon::prelude::*;
    // Spans of whole blocks quantized in parallel (only the last span's last block can be
    // partial, as in one pass).
    const SPAN: usize = BLOCK * 4096;
    let mut packed = vec![0u8; w.len().div_ceil(2)];
    let mut absmax = vec![0f32; w.len().div_ceil(BLOCK)];
    let mids = midpoints(&CODE);
    packed.par_chunks_mut(SPAN / 2).zip(absmax.par_chunks_mut(SPAN / BLOCK)).zip(w.par_chunks(SPAN)).for_each(
        |((packed, absmax), w)| {
            let scales = blockwise(w, BLOCK, |i, x| {
                let code = nearest(&mids, x);
                packed[i / 2] |= if i.is_multiple_of(2) { code << 4 } else { code };
            });
            absmax.copy_from_slice(&scales);
        },
    );
    let (absmax, nested) = match double {
        false => (absmax, None),
        true => {
            let nested = quantize_scales(&absmax);
            (nested.dequantize(), Some(nested))
        }
    };
    Nf4 { packed, absmax, len: w.len(), nested }
}

/// Double quantization of block scales: less their mean, 8-bit blockwise with the dynamic code.
fn quantize_scales(absmax: &[f32]) -> Nested {
    let offset = (absmax.iter().map(|&a| a as f64).sum::<f64>() / absmax.len().max(1) as f64) as f32;
    let centered: Vec<f32> = absmax.iter().map(|a| a - offset).collect();
    let mids = midpoints(&dynamic_code());
    let mut codes = vec![0u8; absmax.len()];
    let scales = blockwise(&centered, SCALE_BLOCK, |i, x| codes[i] = nearest(&mids, x));
    Nested { codes, scales, offset }
}

impl Nested {
    /// The block scales these stand for.
    pub fn dequantize(&self) -> Vec<f32> {
        let code = dynamic_code();
        let scale = |b: usize| code[self.codes[b] as usize] * self.scales[b / SCALE_BLOCK];
        (0..self.codes.len()).map(|b| scale(b) + self.offset).collect()
    }

    /// The 8-bit indices as little-endian 32-bit words (the GPU engine's buffers).
    pub fn words(&self) -> Vec<u32> {
        words(&self.codes)
    }
}

/// Bytes as little-endian 32-bit words, the last padded with zeros.
fn words(bytes: &[u8]) -> Vec<u32> {
    bytes.chunks(4).map(|c| c.iter().enumerate().fold(0u32, |w, (k, b)| w | (*b as u32) << (8 * k))).collect()
}

impl Nf4 {
    /// Value `i`'s code index.
    pub fn index(&self, i: usize) -> usize {
        let byte = self.packed[i / 2];
        (if i.is_multiple_of(2) { byte >> 4 } else { byte & 15 }) as usize
    }

    /// The f32 values the weight stands for.
    pub fn dequantize(&self) -> Vec<f32> {
        (0..self.len).map(|i| CODE[self.index(i)] * self.absmax[i / BLOCK]).collect()
    }

    /// The packed indices as little-endian 32-bit words (the GPU engine's buffers), the last
    /// padded with zeros.
    pub fn words(&self) -> Vec<u32> {
        words(&self.packed)
    }

    /// Bytes the packed form takes: indices and scales (their own indices and scales under
    /// double quantization).
    pub fn bytes(&self) -> usize {
        match &self.nested {
            None => packed_bytes(self.len),
            Some(n) => self.packed.len() + n.codes.len() + 4 * n.scales.len() + 4,
        }
    }
}

/// `w` as a base quantized with `quant` computes with it: quantized and dequantized.
pub fn round_trip(w: &[f32], quant: BaseQuant) -> Vec<f32> {
    quantize(w, quant == BaseQuant::Nf4Dq).dequantize()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_code_is_bitsandbytes_bit_for_bit() {
        let bits = [
            0xbf80_0000u32,
            0xbf32_39b1,
            0xbf06_6b30,
            0xbeca_32a0,
            0xbe91_a24d,
            0xbe3d_353f,
            0xbdba_7871,
            0,
            0x3da2_faff,
            0x3e24_cae3,
            0x3e7c_04dd,
            0x3ead_033a,
            0x3ee1_a4b8,
            0x3f10_07ab,
            0x3f39_13b3,
            0x3f80_0000,
        ];
        assert_eq!(CODE.map(f32::to_bits), bits);
    }

    #[test]
    fn the_code_is_sorted_and_nearest_rounds_to_it() {
        assert!(CODE.windows(2).all(|p| p[0] < p[1]));
        let mids = midpoints(&CODE);
        for (i, c) in CODE.iter().enumerate() {
            assert_eq!(nearest(&mids, *c) as usize, i);
        }
        // Just above a midpoint goes up; on it, down.
        let mid = (CODE[7] + CODE[8]) / 2.0;
        assert_eq!(nearest(&mids, mid), 7);
        assert_eq!(nearest(&mids, f32::from_bits(mid.to_bits() + 1)), 8);
    }

    #[test]
    fn blocks_scale_by_their_largest_magnitude() {
        let mut w: Vec<f32> = (0..130).map(|i| ((i * 37 % 23) as f32 - 11.0) / 7.0).collect();
        w[70] = -9.0;
        let q = quantize(&w, false);
        assert_eq!(q.absmax.len(), 3);
        assert_eq!(q.absmax[1], 9.0);
        assert_eq!(q.packed.len(), 65);
        let d = q.dequantize();
        assert_eq!(d[70], -9.0);
        for (b, block) in w.chunks(BLOCK).enumerate() {
            for (j, x) in block.iter().enumerate() {
                // Within half the widest gap between code values, times the scale.
                assert!((d[b * BLOCK + j] - x).abs() <= 0.16 * q.absmax[b], "{b} {j}");
            }
        }
        // A block of zeros stays zero.
        assert!(round_trip(&[0.0; 70], BaseQuant::Nf4).iter().all(|v| *v == 0.0));
    }

    #[test]
    fn double_quantization_keeps_scales_within_a_step_of_the_dynamic_code() {
        let code = dynamic_code();
        assert!(code.windows(2).all(|p| p[0] < p[1]) && code[255] == 1.0);
        // 600 blocks: scales in three blocks of 256 (the last partial).
        let w: Vec<f32> =
            (0..600 * BLOCK).map(|i| ((i * 7919 % 1000) as f32 - 500.0) * (1.0 + (i / BLOCK) as f32) / 1e4).collect();
        let plain = quantize(&w, false);
        let double = quantize(&w, true);
        assert_eq!(plain.packed, double.packed);
        let n = double.nested.as_ref().unwrap();
        assert_eq!((n.codes.len(), n.scales.len()), (600, 3));
        for (b, (a, d)) in plain.absmax.iter().zip(&double.absmax).enumerate() {
            // The widest step of the code is 1/64 of its range, scaled by the block's scale.
            assert!((a - d).abs() <= n.scales[b / SCALE_BLOCK] / 64.0 + 1e-6, "{b}: {a} vs {d}");
        }
        assert!(double.bytes() * 8 < w.len() * 4127 / 1000 + 64, "{} bytes", double.bytes());
        assert!(plain.bytes() * 8 == w.len() * 9 / 2);
    }

    #[test]
    fn spans_quantized_in_parallel_equal_each_block_alone() {
        // Two spans and a bit, the last block partial (62 values).
        let n = 2 * BLOCK * 4096 + 3 * BLOCK + 62;
        let w: Vec<f32> = (0..n).map(|i| ((i * 7919 % 2003) as f32 - 1001.0) * (1.0 + (i / 640) as f32)).collect();
        let q = quantize(&w, false);
        for (b, block) in w.chunks(BLOCK).enumerate() {
            let alone = quantize(block, false);
            assert_eq!(q.absmax[b], alone.absmax[0], "block {b}");
            assert_eq!(&q.packed[b * BLOCK / 2..(b * BLOCK + block.len()).div_ceil(2)], &alone.packed[..], "block {b}");
        }
    }

    #[test]
    fn only_the_decoder_linears_are_quantized() {
        assert!(quantizes("model.layers.0.self_attn.q_proj.weight"));
        assert!(quantizes("model.layers.31.mlp.down_proj.weight"));
        assert!(!quantizes("model.layers.0.self_attn.q_proj.bias"));
        assert!(!quantizes("model.layers.0.input_layernorm.weight"));
        assert!(!quantizes("model.layers.0.self_attn.q_norm.weight"));
        assert!(!quantizes("lm_head.weight"));
        assert!(!quantizes("model.embed_tokens.weight"));
    }

    #[test]
    fn words_are_little_endian() {
        let q = Nf4 { packed: vec![1, 2, 3, 4, 5], absmax: vec![1.0], len: 10, nested: None };
        assert_eq!(q.words(), vec![0x0403_0201, 5]);
    }
}
