//! One method per kernel of kernels.cu: its launch shape and argument order live here and
//! nowhere else. Pointers are raw device addresses; the compute dtype picks the kernel variant.
// The methods mirror the kernels' signatures, argument for argument.
#![allow(clippy::too_many_arguments)]

use super::device::{Arg, Dt, Gemm, GemmBatch, Gpu, GpuError};

type R = Result<(), GpuError>;

pub(crate) const BLOCK: u32 = 256;
/// Threads per block of the row kernels (norms, cross-entropy).
const ROW_BLOCK: u32 = 256;
/// Threads per block of the attention kernels (4 warps).
const ATT_BLOCK: u32 = 128;
/// Query (or key) rows per block: 4 in the scalar kernels, 64 in the tensor-core ones.
const ATT_ROWS: usize = 4;
const MMA_ROWS: usize = 64;

/// Blocks a grid may have along x on every device: Vulkan guarantees 65535 (Intel's GPUs,
/// MoltenVK and lavapipe allow no more); CUDA allows 2³¹ − 1.
const MAX_GRID_X: usize = 65535;

/// Rows per partial column sum of [`Ops::col_grad`]: a step's 2,048 tokens give its columns
/// 32 times more threads than a thread per column would.
const COL_CHUNK: usize = 64;

/// The grid of an element-wise kernel over `n` elements in workgroups of [`BLOCK`] (a grid-stride
/// loop covers what 16,384 workgroups do not).
pub(crate) fn grid(n: usize) -> [u32; 3] {
    [n.div_ceil(BLOCK as usize).clamp(1, 16384) as u32, 1, 1]
}

fn i(v: usize) -> Arg {
    Arg::I32(i32::try_from(v).expect("sizes fit in i32 (checked when the batch is built)"))
}

/// The kernels of one compute dtype on one device.
#[derive(Clone, Copy)]
pub struct Ops<'g> {
    pub gpu: &'g dyn Gpu,
    pub dt: Dt,
}

/// The shape of one attention call.
#[derive(Debug, Clone, Copy)]
pub struct AttnShape {
    pub b: usize,
    pub t: usize,
    pub hq: usize,
    pub hk: usize,
    pub d: usize,
    pub scale: f32,
    /// Scores become `c · tanh(scores / c)` before the mask (Gemma 2).
    pub softcap: Option<f32>,
    pub kernels: AttnKernels,
}

/// Which attention kernels run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttnKernels {
    /// The tensor-core kernels where they run for the compute dtype and head size; else matrix
    /// products on devices that prefer them ([`Gpu::product_attention`]); else the scalar kernels.
    Auto,
    /// The tensor-core kernels where they run, else the scalar ones.
    TensorCores,
    /// Matrix products over chunks of at most `rows` query rows (0: as many as
    /// [`PRODUCT_SCORES_BYTES`] of scores hold).
    Products { rows: usize },
    /// The scalar reference kernels.
    Scalar,
}

/// How one attention call runs (what [`AttnKernels`] resolves to on a device).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Method {
    TensorCores,
    /// Products over chunks of this many query rows.
    Products(usize),
    Scalar,
}

/// Bytes of scores and probabilities a chunk of product attention may hold (the chunk shrinks to
/// fit, down to 16 query rows).
const PRODUCT_SCORES_BYTES: usize = 64 << 20;
/// The most query rows in a chunk: smaller chunks skip more of the keys no query of theirs sees
/// (a chunk's queries see keys up to its last row only).
const PRODUCT_ROWS: usize = 256;
/// The fewest query rows in a chunk, whatever their scores take.
const PRODUCT_MIN_ROWS: usize = 16;

impl AttnShape {
    /// Tensor-core kernels exist for bf16/f16 with these head sizes.
    pub fn has_tensor_cores(dt: Dt, d: usize) -> bool {
        matches!(dt, Dt::Bf16 | Dt::F16) && matches!(d, 64 | 128)
    }

    fn method(&self, dt: Dt, gpu: &dyn Gpu) -> Method {
        // The tensor-core kernels do not cap scores: capped attention runs through products or on
        // the scalar kernels.
        let tensor_cores =
            || self.softcap.is_none() && Self::has_tensor_cores(dt, self.d) && gpu.tensor_core_attention(dt);
        match self.kernels {
            AttnKernels::Scalar => Method::Scalar,
            AttnKernels::Products { rows } => Method::Products(self.chunk_rows(rows, dt)),
            AttnKernels::TensorCores | AttnKernels::Auto if tensor_cores() => Method::TensorCores,
            AttnKernels::Auto if gpu.product_attention() => Method::Products(self.chunk_rows(0, dt)),
            AttnKernels::TensorCores | AttnKernels::Auto => Method::Scalar,
        }
    }

    /// Which kernels run this attention call on `gpu` in `dt`, in words, for the training log
    /// (run after the call: the tensor-core kernels' first-use check may decide it).
    pub fn account(&self, dt: Dt, gpu: &dyn Gpu) -> String {
        match self.method(dt, gpu) {
            Method::TensorCores => "attention on the matrix units".to_string(),
            Method::Products(rows) => format!("attention through matrix products ({rows} query rows at a time)"),
            Method::Scalar if self.d.is_multiple_of(4) && gpu.cpu_lanes().is_some() => {
                "attention on the per-lane kernels (a CPU device)".to_string()
            }
            Method::Scalar => "attention on the scalar kernels".to_string(),
        }
    }

    /// Query rows per chunk of product attention: `rows`, or (0) as many as fit
    /// [`PRODUCT_SCORES_BYTES`], at most [`PRODUCT_ROWS`], in chunks of equal size.
    fn chunk_rows(&self, rows: usize, dt: Dt) -> usize {
        if rows > 0 {
            return rows.min(self.t).max(1);
        }
        let per_row = self.b * self.hq * self.t * (4 + dt.size());
        let most = (PRODUCT_SCORES_BYTES / per_row.max(1)).clamp(PRODUCT_MIN_ROWS, PRODUCT_ROWS);
        self.t.div_ceil(self.t.div_ceil(most).max(1)).max(1)
    }

    /// The most bytes of scores and probabilities a chunk of product attention holds for a batch
    /// of `tokens` tokens (any shape) with `heads` query heads in `dt`: at most
    /// [`PRODUCT_ROWS`] query rows, and at most [`PRODUCT_SCORES_BYTES`] unless
    /// [`PRODUCT_MIN_ROWS`] need more ([`Self::chunk_rows`]); with `capped` scores, twice the
    /// scores (the backward pass's dP beside them).
    pub fn most_scores_bytes(tokens: usize, heads: usize, dt: Dt, capped: bool) -> usize {
        let per_row = tokens * heads * (4 + dt.size());
        let most = (PRODUCT_ROWS * per_row).min(PRODUCT_SCORES_BYTES.max(PRODUCT_MIN_ROWS * per_row));
        if capped { most + most * 4 / (4 + dt.size()) } else { most }
    }

    /// f32 elements of the scratch memory [`Ops::attn_fwd`] (`backward` false) or
    /// [`Ops::attn_bwd`] takes on `gpu` in `dt`: the backward pass's per-query-head dK and dV
    /// before they are summed per kv head (tensor cores, products), a chunk's scores and
    /// probabilities (products), and with capped scores the backward pass's dP beside the scores
    /// the cap's derivative reads.
    pub fn scratch_len(&self, dt: Dt, gpu: &dyn Gpu, backward: bool) -> usize {
        let partial = if backward { 2 * self.b * self.t * self.hq * self.d } else { 0 };
        match self.method(dt, gpu) {
            Method::TensorCores => partial,
            Method::Products(rows) => {
                let (scores, probs) = self.chunk_layout(rows, dt);
                let dp = if backward && self.softcap.is_some() { scores } else { 0 };
                scores + probs + dp + partial
            }
            Method::Scalar => 0,
        }
    }

    /// The cap as the kernels take it (0: none).
    fn cap(&self) -> Arg {
        Arg::F32(self.softcap.unwrap_or(0.0))
    }

    /// [row pitch, batch stride, head stride] of `[b, t, heads, d]` tensors: query heads, kv heads.
    fn pitches(&self) -> ([usize; 3], [usize; 3]) {
        let d = self.d;
        ([self.hq * d, self.t * self.hq * d, d], [self.hk * d, self.t * self.hk * d, d])
    }

    /// f32 elements of a chunk's scores (f32) and probabilities (`dt`), each a multiple of 16
    /// bytes so that both regions start aligned.
    fn chunk_layout(&self, rows: usize, dt: Dt) -> (usize, usize) {
        let n = self.b * self.hq * rows * self.t;
        (n.next_multiple_of(4), (n * dt.size()).div_ceil(4).next_multiple_of(4))
    }
}

/// One chunk of product attention: query rows `r0 .. r0 + r` (at byte `row` of a `[b, t, hq, d]`
/// tensor in the compute dtype), which see keys `0 .. kn`; `scores` is its scores' and
/// probabilities' [row pitch, batch stride, head stride] (packed, per [`Ops::attn_product`]).
struct Chunk {
    r0: usize,
    r: usize,
    kn: usize,
    row: u64,
    scores: [usize; 3],
}

/// `RTUNE_GPU_ATTENTION=scalar` runs the reference attention kernels, `products` attention
/// through matrix products, instead of the tensor-core ones (to compare them).
pub fn attention_kernels() -> AttnKernels {
    static KERNELS: std::sync::OnceLock<AttnKernels> = std::sync::OnceLock::new();
    *KERNELS.get_or_init(|| match crate::switches::Switches::get().gpu_attention.as_deref() {
        Some("scalar") => AttnKernels::Scalar,
        Some("products") => AttnKernels::Products { rows: 0 },
        _ => AttnKernels::Auto,
    })
}

impl Ops<'_> {
    fn k(&self, name: &str) -> String {
        format!("{name}_{}", self.dt.suffix())
    }

    /// The per-lane (`_sg`) form of an attention kernel for CPU devices, specialised to head size
    /// `d` (in vec4s).
    fn k_sg(&self, name: &str, d: usize) -> String {
        format!("{name}_sg_{}_{}", self.dt.suffix(), d / 4)
    }

    /// Lanes per workgroup of the per-lane attention kernels, on CPU devices and head sizes
    /// they take (multiples of 4).
    fn attn_lanes(&self, d: usize) -> Option<u32> {
        self.gpu.cpu_lanes().filter(|_| d.is_multiple_of(4))
    }

    /// Threads per block of a row kernel: `full` on GPUs, one SIMD vector on CPU devices (where a
    /// barrier switches between the vectors of a block).
    fn row_block(&self, full: u32) -> u32 {
        self.gpu.cpu_lanes().unwrap_or(full)
    }

    /// Launch row kernel `name` (one block per row) over `rows` rows, at most [`MAX_GRID_X`]
    /// at a time: `args(first)` are the arguments with the row pointers moved to row `first`.
    fn per_row(&self, name: &str, rows: usize, block: u32, args: impl Fn(u64) -> Vec<Arg>) -> R {
        for first in (0..rows).step_by(MAX_GRID_X) {
            let grid = [MAX_GRID_X.min(rows - first) as u32, 1, 1];
            self.gpu.launch(&self.k(name), grid, block, &args(first as u64))?;
        }
        Ok(())
    }

    fn run(&self, name: &str, n: usize, args: &[Arg]) -> R {
        self.gpu.launch(&self.k(name), grid(n), BLOCK, args)
    }

    /// `C (m × n, ld n) = alpha · op(A) · op(B) + beta · C`, A and B in the compute dtype.
    pub fn gemm(
        &self,
        c: u64,
        c_dt: Dt,
        a: u64,
        a_trans: bool,
        b: u64,
        b_trans: bool,
        m: usize,
        n: usize,
        k: usize,
        alpha: f32,
        beta: f32,
    ) -> R {
        if m == 0 || n == 0 {
            return Ok(());
        }
        self.gpu.gemm(&Gemm {
            m,
            n,
            k,
            a,
            a_trans,
            lda: if a_trans { m } else { k },
            b,
            b_trans,
            ldb: if b_trans { k } else { n },
            c,
            ldc: n,
            alpha,
            beta,
            ab: self.dt,
            c_dt,
        })
    }

    /// `out = T(table[ids] · scale)` (`scale` 1, or Gemma's √hidden rounded to the compute dtype).
    pub fn embed(&self, ids: u64, table: u64, out: u64, n: usize, h: usize, scale: f32) -> R {
        self.run("embed", n * h, &[Arg::Ptr(ids), Arg::Ptr(table), Arg::Ptr(out), i(n), i(h), Arg::F32(scale)])
    }

    pub fn gather_rows(&self, src: u64, idx: u64, dst: u64, rows: usize, width: usize) -> R {
        self.run("gather_rows", rows * width, &[Arg::Ptr(src), Arg::Ptr(idx), Arg::Ptr(dst), i(rows), i(width)])
    }

    pub fn scatter_add_rows(&self, src: u64, idx: u64, dst: u64, rows: usize, width: usize) -> R {
        self.run("scatter_add_rows", rows * width, &[Arg::Ptr(src), Arg::Ptr(idx), Arg::Ptr(dst), i(rows), i(width)])
    }

    /// `grad[tokens[u]] += scale · Σ dx[rows[k]]` for `k` in `starts[u] .. starts[u + 1]`: a
    /// trained embedding table's f32 gradient (`scale` that of [`Ops::embed`]), the batch's rows
    /// grouped by token (`uniq` tokens).
    #[allow(clippy::too_many_arguments)]
    pub fn embed_bwd(
        &self,
        dx: u64,
        rows: u64,
        starts: u64,
        tokens: u64,
        grad: u64,
        uniq: usize,
        h: usize,
        scale: f32,
    ) -> R {
        let args = [dx, rows, starts, tokens, grad]
            .map(Arg::Ptr)
            .into_iter()
            .chain([i(uniq), i(h), Arg::F32(scale)])
            .collect::<Vec<_>>();
        self.run("embed_bwd", uniq * h, &args)
    }

    /// `out[j] += Σ_r dy[r, j] · T(x[r, j] · inv[r])` over `n` rows of width `w` (an RMSNorm
    /// weight's f32 gradient), or with `x = None` `out[j] += Σ_r dy[r, j]` (a bias's). `partial`
    /// holds [`Ops::col_partials`]`(n, w)` f32 values of scratch.
    pub fn col_grad(&self, dy: u64, x: Option<(u64, u64)>, partial: u64, out: u64, n: usize, w: usize) -> R {
        let chunks = n.div_ceil(COL_CHUNK);
        let (xp, inv) = x.unwrap_or((0, 0));
        let args = [dy, xp, inv, partial].map(Arg::Ptr).into_iter().chain([
            i(n),
            i(w),
            i(COL_CHUNK),
            Arg::I32(x.is_some() as i32),
        ]);
        self.run("col_grad", chunks * w, &args.collect::<Vec<_>>())?;
        self.gpu.launch("col_sum", grid(w), BLOCK, &[Arg::Ptr(partial), Arg::Ptr(out), i(chunks), i(w)])
    }

    /// Scratch values [`Ops::col_grad`] needs for `n` rows of width `w`.
    pub fn col_partials(n: usize, w: usize) -> usize {
        n.div_ceil(COL_CHUNK).max(1) * w
    }

    /// `dst += src` over `n` values (a residual).
    pub fn add(&self, dst: u64, src: u64, n: usize) -> R {
        self.run("add", n, &[Arg::Ptr(dst), Arg::Ptr(src), i(n)])
    }

    pub fn add_bias(&self, y: u64, bias: u64, rows: usize, width: usize) -> R {
        self.run("add_bias", rows * width, &[Arg::Ptr(y), Arg::Ptr(bias), i(rows), i(width)])
    }

    /// `out[i] = code[index i] · absmax[i / 64]` in the compute dtype: a weight kept in 4 bits
    /// ([`crate::model::nf4`]; `packed` as its little-endian words, `code` the 16 NF4 values).
    pub fn nf4_dequant(&self, packed: u64, absmax: u64, code: u64, out: u64, n: usize) -> R {
        self.run("nf4_dequant", n, &[Arg::Ptr(packed), Arg::Ptr(absmax), Arg::Ptr(code), Arg::Ptr(out), i(n)])
    }

    /// `out[b] = code[index b] · scales[b / 256] + offset` in f32: a 4-bit weight's block scales
    /// under double quantization (`codes` as little-endian words of 8-bit indices).
    pub fn nf4_scales(&self, codes: u64, scales: u64, code: u64, offset: f32, out: u64, n: usize) -> R {
        let args = [Arg::Ptr(codes), Arg::Ptr(scales), Arg::Ptr(code), Arg::F32(offset), Arg::Ptr(out), i(n)];
        self.gpu.launch("nf4_scales", grid(n), BLOCK, &args)
    }

    pub fn cast_from_f32(&self, src: u64, dst: u64, n: usize) -> R {
        self.run("cast_from_f32", n, &[Arg::Ptr(src), Arg::Ptr(dst), i(n)])
    }

    /// RMSNorm of `n` rows of width `h` by the weight `w`: `x̂ · w`, or with `offset` Gemma's
    /// `x̂ · (1 + w)` in f32; each row's inverse RMS into `inv`.
    #[allow(clippy::too_many_arguments)]
    pub fn rmsnorm_fwd(&self, x: u64, w: u64, y: u64, inv: u64, n: usize, h: usize, eps: f32, offset: bool) -> R {
        let row = (h * self.dt.size()) as u64;
        self.per_row("rmsnorm_fwd", n, self.row_block(ROW_BLOCK), |r| {
            let ptrs = [x + r * row, w, y + r * row, inv + r * 4];
            ptrs.map(Arg::Ptr).into_iter().chain([i(h), Arg::F32(eps), Arg::I32(offset as i32)]).collect()
        })
    }

    #[allow(clippy::too_many_arguments)]
    pub fn rmsnorm_apply(&self, x: u64, inv: u64, w: u64, y: u64, n: usize, h: usize, offset: bool) -> R {
        let args = [Arg::Ptr(x), Arg::Ptr(inv), Arg::Ptr(w), Arg::Ptr(y), i(n), i(h), Arg::I32(offset as i32)];
        self.run("rmsnorm_apply", n * h, &args)
    }

    #[allow(clippy::too_many_arguments)]
    pub fn rmsnorm_bwd(
        &self,
        x: u64,
        inv: u64,
        w: u64,
        dy: u64,
        dx: u64,
        n: usize,
        h: usize,
        accumulate: bool,
        offset: bool,
    ) -> R {
        let row = (h * self.dt.size()) as u64;
        self.per_row("rmsnorm_bwd", n, self.row_block(ROW_BLOCK), |r| {
            let rows = [x + r * row, inv + r * 4, w, dy + r * row, dx + r * row];
            rows.map(Arg::Ptr).into_iter().chain([i(h), Arg::I32(accumulate as i32), Arg::I32(offset as i32)]).collect()
        })
    }

    pub fn rope(&self, x: u64, pos: u64, cos: u64, sin: u64, n: usize, heads: usize, d: usize, inverse: bool) -> R {
        let args =
            [Arg::Ptr(x), Arg::Ptr(pos), Arg::Ptr(cos), Arg::Ptr(sin), i(n), i(heads), i(d), Arg::I32(inverse as i32)];
        self.run("rope", n * heads * d / 2, &args)
    }

    /// The gated MLP's `a = T(act(g)) · u`: SiLU, or with `gelu` GELU's tanh approximation.
    pub fn swiglu(&self, g: u64, u: u64, a: u64, n: usize, gelu: bool) -> R {
        self.run("swiglu", n, &[Arg::Ptr(g), Arg::Ptr(u), Arg::Ptr(a), i(n), Arg::I32(gelu as i32)])
    }

    #[allow(clippy::too_many_arguments)]
    pub fn swiglu_bwd(&self, g: u64, u: u64, da: u64, dg: u64, du: u64, n: usize, gelu: bool) -> R {
        let args = [Arg::Ptr(g), Arg::Ptr(u), Arg::Ptr(da), Arg::Ptr(dg), Arg::Ptr(du), i(n), Arg::I32(gelu as i32)];
        self.run("swiglu_bwd", n, &args)
    }

    /// `y = x ⊙ mask` (inverted dropout; `y` may be `x`) for elements `offset ..` of the
    /// adapter's whole input.
    pub fn dropout(&self, x: u64, y: u64, key: u64, offset: usize, p: f64, n: usize) -> R {
        self.masked("dropout", x, y, key, offset, p, n)
    }

    /// `dst += src ⊙ mask`.
    pub fn dropout_acc(&self, src: u64, dst: u64, key: u64, offset: usize, p: f64, n: usize) -> R {
        self.masked("dropout_acc", src, dst, key, offset, p, n)
    }

    /// A dropout kernel over `n` elements from `src` to `dst`, its mask drawn from `key` at
    /// element `offset` with drop probability `p`.
    fn masked(&self, kernel: &str, src: u64, dst: u64, key: u64, offset: usize, p: f64, n: usize) -> R {
        let (threshold, scale) = crate::model::lora::dropout_params(p);
        let args = [
            Arg::Ptr(src),
            Arg::Ptr(dst),
            Arg::U64(key),
            Arg::U64(offset as u64),
            Arg::U32(threshold),
            Arg::F32(scale),
            i(n),
        ];
        self.run(kernel, n, &args)
    }

    /// Each row's loss `logsumexp(z) − z[target]` of the logits `z`, capped as `c · tanh(z / c)`
    /// first where `cap` is given; with a non-zero `grad_scale` the logits become their gradient.
    #[allow(clippy::too_many_arguments)]
    pub fn cross_entropy(
        &self,
        logits: u64,
        targets: u64,
        loss: u64,
        rows: usize,
        vocab: usize,
        grad_scale: f32,
        cap: Option<f32>,
    ) -> R {
        let row = (vocab * self.dt.size()) as u64;
        self.per_row("cross_entropy", rows, self.row_block(512), |r| {
            let rows = [logits + r * row, targets + r * 4, loss + r * 4];
            let tail = [i(vocab), Arg::F32(grad_scale), Arg::F32(cap.unwrap_or(0.0))];
            rows.map(Arg::Ptr).into_iter().chain(tail).collect()
        })
    }

    /// `out[0] += weight · Σ x` in f64.
    pub fn sum_scaled(&self, x: u64, n: usize, weight: f32, out: u64) -> R {
        self.gpu.launch("sum_scaled", grid(n), BLOCK, &[Arg::Ptr(x), i(n), Arg::F32(weight), Arg::Ptr(out)])
    }

    /// `out[0] += Σ x²` in f64.
    pub fn sum_squares(&self, x: u64, n: usize, out: u64) -> R {
        self.gpu.launch("sum_squares", grid(n), BLOCK, &[Arg::Ptr(x), i(n), Arg::Ptr(out)])
    }

    /// `e = e·decay + w·(1 − decay)`, both coefficients rounded from f64 as candle rounds them.
    pub fn ema(&self, e: u64, w: u64, decay: f64, n: usize) -> R {
        let args = [Arg::Ptr(e), Arg::Ptr(w), Arg::F32(decay as f32), Arg::F32((1.0 - decay) as f32), i(n)];
        self.gpu.launch("ema", grid(n), BLOCK, &args)
    }

    /// AdamW over `n` f32 values; `c` holds the step's coefficients.
    pub fn adamw(&self, w: u64, g: u64, m: u64, v: u64, n: usize, c: &AdamWCoefficients) -> R {
        let args = [
            Arg::Ptr(w),
            Arg::Ptr(g),
            Arg::Ptr(m),
            Arg::Ptr(v),
            i(n),
            Arg::F32(c.decay),
            Arg::F32(c.one_minus_b1),
            Arg::F32(c.b2),
            Arg::F32(c.one_minus_b2),
            Arg::F32(c.step_size),
            Arg::F32(c.bc2_sqrt),
            Arg::F32(c.eps),
            Arg::F32(c.grad_scale),
        ];
        self.gpu.launch("adamw", grid(n), BLOCK, &args)
    }

    /// Attention forward: `o` and the log-sum-exp of every row; `scratch` holds
    /// [`AttnShape::scratch_len`] f32 values.
    pub fn attn_fwd(
        &self,
        s: &AttnShape,
        q: u64,
        k: u64,
        v: u64,
        o: u64,
        lse: u64,
        lo: u64,
        hi: u64,
        scratch: u64,
    ) -> R {
        let ptrs = [q, k, v, o, lse, lo, hi].map(Arg::Ptr);
        let dims = [i(s.t), i(s.hq), i(s.hk)];
        let method = s.method(self.dt, self.gpu);
        if let Method::Products(rows) = method {
            return self.attn_fwd_products(s, rows, [q, k, v, o, lse, lo, hi], scratch);
        }
        if method == Method::TensorCores {
            let name = format!("attn_fwd_mma_{}_{}", self.dt.suffix(), s.d);
            let grid = [s.t.div_ceil(MMA_ROWS) as u32, s.hq as u32, s.b as u32];
            let args: Vec<Arg> = ptrs.into_iter().chain(dims).chain([Arg::F32(s.scale)]).collect();
            return self.gpu.launch(&name, grid, ATT_BLOCK, &args);
        }
        let args: Vec<Arg> = ptrs.into_iter().chain(dims).chain([i(s.d), Arg::F32(s.scale), s.cap()]).collect();
        if let Some(lanes) = self.attn_lanes(s.d) {
            let grid = [s.t.div_ceil(lanes as usize) as u32, s.hq as u32, s.b as u32];
            return self.gpu.launch(&self.k_sg("attn_fwd", s.d), grid, lanes, &args);
        }
        let grid = [s.t.div_ceil(ATT_ROWS) as u32, s.hq as u32, s.b as u32];
        self.gpu.launch(&self.k("attn_fwd"), grid, ATT_BLOCK, &args)
    }

    /// Attention backward: `delta` (scratch, `[b, hq, t]` f32), `scratch` ([`AttnShape::scratch_len`]
    /// f32 values) and the gradients of q, k and v.
    pub fn attn_bwd(
        &self,
        s: &AttnShape,
        q: u64,
        k: u64,
        v: u64,
        o: u64,
        dout: u64,
        lse: u64,
        delta: u64,
        scratch: u64,
        dq: u64,
        dk: u64,
        dv: u64,
        lo: u64,
        hi: u64,
    ) -> R {
        let pre_grid = [s.t.div_ceil(ATT_ROWS) as u32, s.hq as u32, s.b as u32];
        let pre = [Arg::Ptr(o), Arg::Ptr(dout), Arg::Ptr(delta), i(s.t), i(s.hq), i(s.d)];
        self.gpu.launch(&self.k("attn_bwd_pre"), pre_grid, ATT_BLOCK, &pre)?;
        let dims = [i(s.t), i(s.hq), i(s.hk)];
        let dq_args = [q, k, v, dout, lse, delta, dq, lo, hi].map(Arg::Ptr);
        let method = s.method(self.dt, self.gpu);
        if let Method::Products(rows) = method {
            return self.attn_bwd_products(s, rows, [q, k, v, dout, lse, delta, dq, dk, dv, lo, hi], scratch);
        }
        if method == Method::TensorCores {
            let suffix = format!("{}_{}", self.dt.suffix(), s.d);
            let tail = [Arg::F32(s.scale)];
            let a: Vec<Arg> = dq_args.into_iter().chain(dims).chain(tail).collect();
            let grid = [s.t.div_ceil(MMA_ROWS) as u32, s.hq as u32, s.b as u32];
            self.gpu.launch(&format!("attn_bwd_dq_mma_{suffix}"), grid, ATT_BLOCK, &a)?;
            // One block per 64 keys and query head (a grid as wide as the forward pass's), then a
            // sum over the query heads that share each kv head.
            let (part_k, part_v) = (scratch, scratch + (s.b * s.t * s.hq * s.d * 4) as u64);
            let dkv = [q, k, v, dout, lse, delta, part_k, part_v, lo, hi].map(Arg::Ptr);
            let a: Vec<Arg> = dkv.into_iter().chain(dims).chain(tail).collect();
            self.gpu.launch(&format!("attn_bwd_dkv_mma_{suffix}"), grid, ATT_BLOCK, &a)?;
            return self.reduce_heads(s, part_k, part_v, dk, dv);
        }
        let tail = [i(s.d), Arg::F32(s.scale), s.cap()];
        let dq_args: Vec<Arg> = dq_args.into_iter().chain(dims).chain(tail).collect();
        let dkv_args = [q, k, v, dout, lse, delta, dk, dv, lo, hi].map(Arg::Ptr);
        let dkv_args: Vec<Arg> = dkv_args.into_iter().chain(dims).chain(tail).collect();
        if let Some(lanes) = self.attn_lanes(s.d) {
            let rows = s.t.div_ceil(lanes as usize) as u32;
            self.gpu.launch(&self.k_sg("attn_bwd_dq", s.d), [rows, s.hq as u32, s.b as u32], lanes, &dq_args)?;
            return self.gpu.launch(&self.k_sg("attn_bwd_dkv", s.d), [rows, s.hk as u32, s.b as u32], lanes, &dkv_args);
        }
        self.gpu.launch(&self.k("attn_bwd_dq"), pre_grid, ATT_BLOCK, &dq_args)?;
        let grid = [s.t.div_ceil(ATT_ROWS) as u32, s.hk as u32, s.b as u32];
        self.gpu.launch(&self.k("attn_bwd_dkv"), grid, ATT_BLOCK, &dkv_args)
    }

    /// dK and dV per kv head from the per-query-head f32 partials `[b·t, hq, d]`.
    fn reduce_heads(&self, s: &AttnShape, part_k: u64, part_v: u64, dk: u64, dv: u64) -> R {
        let n = s.b * s.t;
        let args = [Arg::Ptr(part_k), Arg::Ptr(part_v), Arg::Ptr(dk), Arg::Ptr(dv), i(n), i(s.hq), i(s.hk), i(s.d)];
        self.run("attn_reduce_heads", n * s.hk * s.d, &args)
    }

    /// A batched product of attention: `m × n × k` for each of the `b · hq` heads. `a` and `b`
    /// are `(address, [row pitch, batch stride, head stride], group)`: an operand read per query
    /// head (group 1), per kv head (group hq / hk) or from the chunk's scores (`[kn, hq · rows · kn,
    /// rows · kn]`); C likewise.
    fn attn_product(
        &self,
        s: &AttnShape,
        [m, n, k]: [usize; 3],
        (a, a_trans, [lda, ao, ah], a_group): (u64, bool, [usize; 3], usize),
        (b, b_trans, [ldb, bo, bh], b_group): (u64, bool, [usize; 3], usize),
        (c, c_dt, [ldc, co, ch]): (u64, Dt, [usize; 3]),
        alpha: f32,
        beta: f32,
    ) -> R {
        let g = Gemm { m, n, k, a, a_trans, lda, b, b_trans, ldb, c, ldc, alpha, beta, ab: self.dt, c_dt };
        let batch =
            GemmBatch { count: s.b * s.hq, heads: s.hq, a: [ao, ah], a_group, b: [bo, bh], b_group, c: [co, ch] };
        self.gpu.gemm_batched(&g, &batch)
    }

    /// The chunks of product attention over `rows` query rows each, in order.
    fn chunks(&self, s: &AttnShape, rows: usize) -> Vec<Chunk> {
        let rows = rows.max(1);
        let chunk = |r0: usize| {
            let (r, kn) = (rows.min(s.t - r0), (r0 + rows).min(s.t));
            let row = (r0 * s.hq * s.d * self.dt.size()) as u64;
            Chunk { r0, r, kn, row, scores: [kn, s.hq * r * kn, r * kn] }
        };
        (0..s.t).step_by(rows).map(chunk).collect()
    }

    /// S = scale · Q Kᵀ of chunk `c` into `scores` (f32), then P from it into `probs`
    /// (`attn_probs`: forward, also each row's log-sum-exp into `lse`).
    fn chunk_probs(
        &self,
        s: &AttnShape,
        c: &Chunk,
        [q, k]: [u64; 2],
        [scores, probs, lse, lo, hi]: [u64; 5],
        fwd: bool,
    ) -> R {
        let (qs, kvs) = s.pitches();
        let qk = ((q + c.row, false, qs, 1), (k, true, kvs, s.hq / s.hk));
        self.attn_product(s, [c.r, c.kn, s.d], qk.0, qk.1, (scores, Dt::F32, c.scores), s.scale, 0.0)?;
        let args = [scores, probs, lse, lo, hi].map(Arg::Ptr).into_iter();
        let tail = [i(s.t), i(s.hq), i(c.r0), i(c.r), i(c.kn), Arg::I32(fwd as i32), s.cap()];
        let args: Vec<Arg> = args.chain(tail).collect();
        let grid = [c.r as u32, (s.b * s.hq) as u32, 1];
        self.gpu.launch(&self.k("attn_probs"), grid, self.row_block(ROW_BLOCK), &args)
    }

    /// Attention forward through matrix products, `rows` query rows at a time: S = scale · Q Kᵀ
    /// for the keys the chunk's queries can see (f32), P = softmax(S) in the compute dtype (and
    /// each row's log-sum-exp), O = P V.
    fn attn_fwd_products(&self, s: &AttnShape, rows: usize, [q, k, v, o, lse, lo, hi]: [u64; 7], scratch: u64) -> R {
        let (scores, probs) = (scratch, scratch + (s.chunk_layout(rows, self.dt).0 * 4) as u64);
        let (qs, kvs) = s.pitches();
        for c in self.chunks(s, rows) {
            self.chunk_probs(s, &c, [q, k], [scores, probs, lse, lo, hi], true)?;
            let (p, v) = ((probs, false, c.scores, 1), (v, false, kvs, s.hq / s.hk));
            self.attn_product(s, [c.r, s.d, c.kn], p, v, (o + c.row, self.dt, qs), 1.0, 0.0)?;
        }
        Ok(())
    }

    /// Attention backward through matrix products, a chunk of `rows` query rows at a time from the
    /// last: P recomputed from S and the forward pass's log-sum-exp, dV += Pᵀ dO, dP = dO Vᵀ,
    /// dS = P ⊙ (dP − delta) (times the cap's derivative at S, which dP is then kept beside),
    /// dQ = scale · dS K, dK += scale · dSᵀ Q — dK and dV per query head in f32 (the last chunk,
    /// which sees every key, writes them first), summed per kv head at the end.
    fn attn_bwd_products(
        &self,
        s: &AttnShape,
        rows: usize,
        [q, k, v, dout, lse, delta, dq, dk, dv, lo, hi]: [u64; 11],
        scratch: u64,
    ) -> R {
        let (dt, rep) = (self.dt, s.hq / s.hk);
        let (scores_len, probs_len) = s.chunk_layout(rows, dt);
        let (scores, probs) = (scratch, scratch + (scores_len * 4) as u64);
        // dP overwrites the scores unless the cap's derivative reads them.
        let (dp, dp_len) = match s.softcap {
            Some(_) => (scratch + ((scores_len + probs_len) * 4) as u64, scores_len),
            None => (scores, 0),
        };
        let part_k = scratch + ((scores_len + probs_len + dp_len) * 4) as u64;
        let part_v = part_k + (s.b * s.t * s.hq * s.d * 4) as u64;
        let (qs, kvs) = s.pitches();
        for (n, c) in self.chunks(s, rows).iter().rev().enumerate() {
            let beta = if n == 0 { 0.0 } else { 1.0 };
            let ([r, kn, d], row) = ([c.r, c.kn, s.d], c.row);
            self.chunk_probs(s, c, [q, k], [scores, probs, lse, lo, hi], false)?;
            let (p, p_t) = ((probs, false, c.scores, 1), (probs, true, c.scores, 1));
            let do_rows = (dout + row, false, qs, 1);
            self.attn_product(s, [kn, d, r], p_t, do_rows, (part_v, Dt::F32, qs), 1.0, beta)?;
            self.attn_product(s, [r, kn, d], do_rows, (v, true, kvs, rep), (dp, Dt::F32, c.scores), 1.0, 0.0)?;
            let total = s.b * s.hq * r * kn;
            let ptrs = [probs, dp, delta, scores].map(Arg::Ptr);
            let args: Vec<Arg> = ptrs.into_iter().chain([i(s.t), i(c.r0), i(r), i(kn), i(total), s.cap()]).collect();
            self.run("attn_dscores", total, &args)?;
            self.attn_product(s, [r, d, kn], p, (k, false, kvs, rep), (dq + row, dt, qs), s.scale, 0.0)?;
            self.attn_product(s, [kn, d, r], p_t, (q + row, false, qs, 1), (part_k, Dt::F32, qs), s.scale, beta)?;
        }
        self.reduce_heads(s, part_k, part_v, dk, dv)
    }
}

/// One AdamW step's coefficients, computed in f64 and rounded once, as src/engine/params.rs does.
#[derive(Debug, Clone, Copy)]
pub struct AdamWCoefficients {
    pub decay: f32,
    pub one_minus_b1: f32,
    pub b2: f32,
    pub one_minus_b2: f32,
    pub step_size: f32,
    pub bc2_sqrt: f32,
    pub eps: f32,
    pub grad_scale: f32,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(b: usize, t: usize, hq: usize) -> AttnShape {
        AttnShape { b, t, hq, hk: 1, d: 64, scale: 0.125, softcap: None, kernels: AttnKernels::Auto }
    }

    #[test]
    fn product_attention_chunks_share_rows_evenly_within_their_scratch() {
        // SmolLM2-360M at 4 × 512 in bf16: two chunks of 256 rows (47 MB each).
        assert_eq!(shape(4, 512, 15).chunk_rows(0, Dt::Bf16), 256);
        // A short row: one chunk; a forced size is kept.
        assert_eq!(shape(1, 150, 4).chunk_rows(0, Dt::Bf16), 150);
        assert_eq!(shape(1, 150, 4).chunk_rows(48, Dt::F32), 48);
        // 2 × 2048 with 16 heads: 170 rows fit, so 13 chunks of 158.
        assert_eq!(shape(2, 2048, 16).chunk_rows(0, Dt::Bf16), 158);
        // 8 × 4096 with 32 heads: not even 16 rows fit; 16 it is.
        assert_eq!(shape(8, 4096, 32).chunk_rows(0, Dt::Bf16), 16);
        for (b, t, hq) in [(1, 7, 1), (4, 512, 15), (2, 2048, 16), (3, 1000, 9), (16, 1024, 32)] {
            let s = shape(b, t, hq);
            for dt in [Dt::F32, Dt::Bf16] {
                let rows = s.chunk_rows(0, dt);
                let (scores, probs) = s.chunk_layout(rows, dt);
                assert!(rows == 16 || (scores + probs) * 4 <= PRODUCT_SCORES_BYTES + 32, "{b}×{t}×{hq}: {rows} rows");
                assert!(scores % 4 == 0 && probs % 4 == 0 && scores * 4 >= b * hq * rows * t * 4);
                // What the engine's memory model counts holds it.
                assert!(
                    (scores + probs) * 4 <= AttnShape::most_scores_bytes(b * t, hq, dt, false) + 32,
                    "{b}×{t}×{hq}"
                );
                // Capped scores keep the backward pass's dP beside them.
                let capped = AttnShape::most_scores_bytes(b * t, hq, dt, true);
                assert!((2 * scores + probs) * 4 <= capped + 64, "{b}×{t}×{hq} capped");
                // Equal chunks: the last is no more than one row shorter per chunk.
                assert!(t.div_ceil(rows) * rows - t < t.div_ceil(rows), "{b}×{t}×{hq}: {rows} rows");
            }
        }
    }
}
