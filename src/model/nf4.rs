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

/// A weight in NF4: `packed[i / 2]` holds value `i`'s code index (high nibble for even `i`);
/// `absmax[i / BLOCK]` its block's scale.
#[derive(Debug, Clone, PartialEq)]
pub struct Nf4 {
    pub packed: Vec<u8>,
    pub absmax: Vec<f32>,
    pub len: usize,
}

/// Whether the base weight `name` is stored in NF4 when the base is quantized: the weights of
/// the decoder layers' linears.
pub fn quantizes(name: &str) -> bool {
    let Some(rest) = name.strip_prefix("model.layers.") else { return false };
    let Some((layer, rest)) = rest.split_once('.') else { return false };
    layer.bytes().all(|b| b.is_ascii_digit())
        && rest.strip_suffix(".weight").is_some_and(|linear| LAYER_LINEARS.contains(&linear))
}

/// Whether the base weight `name` is stored in 4 bits under `quant`; an error when it also
/// trains in full (a 4-bit weight has no gradient to follow).
pub fn stored(quant: Option<BaseQuant>, trainable: &Trainable, name: &str) -> Result<bool, ModelError> {
    let stored = quant.is_some() && quantizes(name);
    if stored && trainable.trains_weight(name) {
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
    let (h, inter) = (cfg.hidden_size, cfg.intermediate_size);
    let (qd, kvd) = (cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim);
    let sizes = [h * qd, h * kvd, h * kvd, qd * h, h * inter, h * inter, inter * h];
    let packed: usize = sizes.iter().map(|n| n.div_ceil(2) + 4 * n.div_ceil(BLOCK)).sum();
    let values: usize = sizes.iter().sum();
    ((values * cfg.num_layers * dtype_bytes) as u64, (packed * cfg.num_layers) as u64)
}

/// The index of the code value nearest to `x` (in [-1, 1]): the number of midpoints between
/// consecutive code values below it, a value on a midpoint going to the lower one
/// (bitsandbytes' `torch.bucketize` against the midpoints).
fn nearest(x: f32) -> u8 {
    let mut i = 0u8;
    while (i as usize) < 15 && x > (CODE[i as usize] + CODE[i as usize + 1]) / 2.0 {
        i += 1;
    }
    i
}

/// Quantize `w` (a flattened weight) as bitsandbytes does: per block, `absmax` = the largest
/// magnitude, values scaled by `1 / absmax` (at least 1e-38), clamped to [-1, 1] and rounded to
/// the nearest code value.
pub fn quantize(w: &[f32]) -> Nf4 {
    let mut packed = vec![0u8; w.len().div_ceil(2)];
    let mut absmax = Vec::with_capacity(w.len().div_ceil(BLOCK));
    for (b, block) in w.chunks(BLOCK).enumerate() {
        let m = block.iter().fold(0f32, |m, x| m.max(x.abs()));
        let inv = 1.0 / m.max(1e-38);
        absmax.push(m);
        for (j, x) in block.iter().enumerate() {
            let i = b * BLOCK + j;
            let code = nearest((x * inv).clamp(-1.0, 1.0));
            packed[i / 2] |= if i.is_multiple_of(2) { code << 4 } else { code };
        }
    }
    Nf4 { packed, absmax, len: w.len() }
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
        self.packed.chunks(4).map(|c| c.iter().enumerate().fold(0u32, |w, (k, b)| w | (*b as u32) << (8 * k))).collect()
    }

    /// Bytes the packed form takes: indices and scales.
    pub fn bytes(&self) -> usize {
        self.packed.len() + 4 * self.absmax.len()
    }
}

/// `w` as the NF4 base computes with it: quantized and dequantized.
pub fn round_trip(w: &[f32]) -> Vec<f32> {
    quantize(w).dequantize()
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
        for (i, c) in CODE.iter().enumerate() {
            assert_eq!(nearest(*c) as usize, i);
        }
        // Just above a midpoint goes up; on it, down.
        let mid = (CODE[7] + CODE[8]) / 2.0;
        assert_eq!(nearest(mid), 7);
        assert_eq!(nearest(f32::from_bits(mid.to_bits() + 1)), 8);
    }

    #[test]
    fn blocks_scale_by_their_largest_magnitude() {
        let mut w: Vec<f32> = (0..130).map(|i| ((i * 37 % 23) as f32 - 11.0) / 7.0).collect();
        w[70] = -9.0;
        let q = quantize(&w);
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
        assert!(round_trip(&[0.0; 70]).iter().all(|v| *v == 0.0));
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
        let q = Nf4 { packed: vec![1, 2, 3, 4, 5], absmax: vec![1.0], len: 10 };
        assert_eq!(q.words(), vec![0x0403_0201, 5]);
    }
}
