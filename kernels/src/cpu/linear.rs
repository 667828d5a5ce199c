//! The linear layer `out = x · Wᵀ (+ bias)`, with `W` in the Hugging Face
//! `[out_features, in_features]` layout, computed by the `gemm` crate (which
//! packs and vectorizes; we only describe strides).

use super::{KernelError, check};

/// `x` is `m × k`, `w` is `n × k`, `out` is `m × n`. Uses the rayon pool.
pub fn linear(
    x: &[f32],
    w: &[f32],
    bias: Option<&[f32]>,
    m: usize,
    k: usize,
    n: usize,
    out: &mut [f32],
) -> Result<(), KernelError> {
    check("linear", x.len() == m * k && w.len() == n * k && out.len() == m * n, || {
        format!("x {} (want {m}×{k}), w {} (want {n}×{k}), out {} (want {m}×{n})", x.len(), w.len(), out.len())
    })?;
    if let Some(b) = bias {
        check("linear", b.len() == n, || format!("bias has {} values, want {n}", b.len()))?;
    }
    if m == 0 || n == 0 {
        return Ok(());
    }
    if k == 0 {
        out.fill(0.0);
    } else {
        let threads = rayon::current_num_threads();
        let par = if threads > 1 && m * n * k >= 64 * 64 * 64 {
            gemm::Parallelism::Rayon(threads)
        } else {
            gemm::Parallelism::None
        };
        // SAFETY: the shape checks above guarantee every pointer/stride pair addresses only
        // elements inside its slice: dst m×n row-major (rs = n, cs = 1), lhs m×k row-major
        // (rs = k, cs = 1), rhs = Wᵀ, a k×n view of the n×k row-major W (rs = 1, cs = k).
        unsafe {
            gemm::gemm(
                m,
                n,
                k,
                out.as_mut_ptr(),
                1,
                n as isize,
                false,
                x.as_ptr(),
                1,
                k as isize,
                w.as_ptr(),
                k as isize,
                1,
                0.0f32,
                1.0f32,
                false,
                false,
                false,
                par,
            );
        }
    }
    if let Some(b) = bias {
        for row in out.chunks_mut(n) {
            for (o, &bv) in row.iter_mut().zip(b) {
                *o += bv;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng, rngs::StdRng};

    #[test]
    fn matches_naive_f64_on_random_odd_shapes() {
        let mut rng = StdRng::seed_from_u64(11);
        for &(m, k, n) in &[(1, 7, 5), (3, 64, 33), (17, 129, 70), (65, 96, 96)] {
            let x: Vec<f32> = (0..m * k).map(|_| rng.random_range(-1.0..1.0)).collect();
            let w: Vec<f32> = (0..n * k).map(|_| rng.random_range(-1.0..1.0)).collect();
            let b: Vec<f32> = (0..n).map(|_| rng.random_range(-1.0..1.0)).collect();
            let mut out = vec![f32::NAN; m * n];
            linear(&x, &w, Some(&b), m, k, n, &mut out).unwrap();
            let mut err = 0.0f64;
            let mut norm = 0.0f64;
            for i in 0..m {
                for j in 0..n {
                    let want: f64 =
                        (0..k).map(|t| x[i * k + t] as f64 * w[j * k + t] as f64).sum::<f64>() + b[j] as f64;
                    err += (out[i * n + j] as f64 - want).powi(2);
                    norm += want * want;
                }
            }
            assert!((err / norm).sqrt() < 1e-5, "m={m} k={k} n={n}: rel err {}", (err / norm).sqrt());
        }
        assert!(linear(&[0.0; 6], &[0.0; 6], None, 2, 3, 3, &mut [0.0; 6]).is_err());
    }
}
