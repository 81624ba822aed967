//! SiTU-GLU, `β1·tanh(g/β1)·sigmoid(g) · β2·tanh(u/β2)`, on `vmath`'s exp, tanh and sigmoid,
//! so the scalar, AVX2 and AVX-512 forms run the very same IEEE operations and agree bit for bit.

use crate::error::{Error, Result};
use crate::kernels::Kernels;
use crate::vmath::{sigmoid, tanh};

/// SiTU betas. `linear_beta: None` passes the up projection through unchanged (as HF does when
/// `activation_situ_linear_beta` is null).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Situ {
    /// β1, the gate's tanh scale.
    pub beta: f32,
    /// β2, the up projection's tanh scale; `None` for none.
    pub linear_beta: Option<f32>,
}

impl Situ {
    /// K3's betas (config `activation_situ_beta` 4.0, `activation_situ_linear_beta` 25.0).
    pub const K3: Situ = Situ {
        beta: 4.0,
        linear_beta: Some(25.0),
    };

    /// One element (the scalar definition).
    #[inline]
    pub fn eval(&self, gate: f32, up: f32) -> f32 {
        let activated = self.beta * tanh(gate / self.beta) * sigmoid(gate);
        let linear = match self.linear_beta {
            Some(b) => b * tanh(up / b),
            None => up,
        };
        activated * linear
    }

    /// `out[i] = eval(gate[i], up[i])` with the kernels' tier (identical bits in every tier).
    /// The three slices must have one length.
    pub fn apply(
        &self,
        kernels: &Kernels,
        gate: &[f32],
        up: &[f32],
        out: &mut [f32],
    ) -> Result<()> {
        for found in [gate.len(), up.len()] {
            if found != out.len() {
                return Err(Error::OutputLength {
                    expected: found,
                    found: out.len(),
                });
            }
        }
        #[cfg(target_arch = "x86_64")]
        if let Some(token) = kernels.avx2() {
            // SAFETY: the token proves avx2/fma/f16c were detected on this CPU.
            unsafe { simd::apply_avx2(token, self, gate, up, out) };
            return Ok(());
        }
        let done = match kernels.avx512() {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the token proves avx512f/bw/vl were detected on this CPU.
            Some(token) => unsafe { simd::apply(token, self, gate, up, out) },
            _ => 0,
        };
        for i in done..out.len() {
            out[i] = self.eval(gate[i], up[i]);
        }
        Ok(())
    }
}

#[cfg(target_arch = "x86_64")]
mod simd {
    //! `Situ::eval`'s operations, 16 lanes at a time.

    use core::arch::x86_64::*;

    use super::Situ;
    use crate::isa::{Avx2, Avx512};
    use crate::vmath::simd::{sigmoid, tanh};

    /// `Situ::eval` over all elements, compiled for avx2 and fma: the scalar operations (the
    /// same bits), `mul_add` as FMA instructions.
    ///
    /// # Safety
    /// The CPU must have avx2 and fma (the token says it has); slices of equal length.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn apply_avx2(
        _: Avx2,
        situ: &Situ,
        gate: &[f32],
        up: &[f32],
        out: &mut [f32],
    ) {
        for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
            *o = situ.eval(g, u);
        }
    }

    /// Processes whole vectors of 16 and returns how many elements it did.
    ///
    /// # Safety
    /// The CPU must have avx512f (the token says it has); slices of equal length.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn apply(
        _: Avx512,
        situ: &Situ,
        gate: &[f32],
        up: &[f32],
        out: &mut [f32],
    ) -> usize {
        let beta = _mm512_set1_ps(situ.beta);
        let whole = out.len() / 16 * 16;
        for i in (0..whole).step_by(16) {
            // SAFETY: i + 16 <= len of all three slices.
            let (g, u) = unsafe {
                (
                    _mm512_loadu_ps(gate.as_ptr().add(i)),
                    _mm512_loadu_ps(up.as_ptr().add(i)),
                )
            };
            let activated = _mm512_mul_ps(
                _mm512_mul_ps(beta, tanh(_mm512_div_ps(g, beta))),
                sigmoid(g),
            );
            let linear = match situ.linear_beta {
                Some(b) => {
                    let b = _mm512_set1_ps(b);
                    _mm512_mul_ps(b, tanh(_mm512_div_ps(u, b)))
                }
                None => u,
            };
            // SAFETY: as above.
            unsafe { _mm512_storeu_ps(out.as_mut_ptr().add(i), _mm512_mul_ps(activated, linear)) };
        }
        whole
    }
}
