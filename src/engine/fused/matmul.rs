//! Matrix products: strided views over f32 buffers, through the `gemm` crate.

use super::*;

/// A read-only matrix view: element (i, j) is `data[i·rs + j·cs]`.
#[derive(Clone, Copy)]
pub(super) struct Mat<'a> {
    pub(super) data: &'a [f32],
    pub(super) rows: usize,
    pub(super) cols: usize,
    pub(super) rs: usize,
    pub(super) cs: usize,
}

impl<'a> Mat<'a> {
    /// Row-major `rows × cols`.
    pub(super) fn rm(data: &'a [f32], rows: usize, cols: usize) -> Mat<'a> {
        Mat { data, rows, cols, rs: cols, cs: 1 }
    }

    pub(super) fn t(self) -> Mat<'a> {
        Mat { data: self.data, rows: self.cols, cols: self.rows, rs: self.cs, cs: self.rs }
    }
}

/// Products smaller than this many multiply-adds run on the calling thread.
pub(super) const PARALLEL_MIN: usize = 1 << 18;

/// `dst (row-major m × n) = [dst +] beta · a · b`, on all threads when it is large enough.
pub(super) fn matmul(dst: &mut [f32], a: Mat<'_>, b: Mat<'_>, beta: f32, accumulate: bool) {
    product(dst, a, b, beta, accumulate, true)
}

/// [`matmul`] on the calling thread (inside a parallel task).
pub(super) fn matmul_here(dst: &mut [f32], a: Mat<'_>, b: Mat<'_>, beta: f32, accumulate: bool) {
    product(dst, a, b, beta, accumulate, false)
}

pub(super) fn product(dst: &mut [f32], a: Mat<'_>, b: Mat<'_>, beta: f32, accumulate: bool, parallel: bool) {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    assert_eq!(k, b.rows, "inner dimensions");
    assert_eq!(dst.len(), m * n, "destination size");
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            dst.fill(0.0);
        }
        return;
    }
    for v in [a, b] {
        assert!((v.rows - 1) * v.rs + (v.cols - 1) * v.cs < v.data.len(), "view within its buffer");
    }
    let parallelism = if parallel && m * n * k >= PARALLEL_MIN && rayon::current_num_threads() > 1 {
        Parallelism::Rayon(rayon::current_num_threads())
    } else {
        Parallelism::None
    };
    // SAFETY: the asserts above keep every element gemm reads inside `a.data`/`b.data` and
    // every element it writes inside `dst` (row-major, m × n); `dst` is borrowed mutably, so it
    // cannot alias the inputs.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            n as isize,
            accumulate,
            a.data.as_ptr(),
            a.cs as isize,
            a.rs as isize,
            b.data.as_ptr(),
            b.cs as isize,
            b.rs as isize,
            1.0,
            beta,
            false,
            false,
            false,
            parallelism,
        )
    }
}
