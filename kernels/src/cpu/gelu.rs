//! GELU in the two forms the vision tower uses: the tanh approximation of the tower's MLP
//! (`gelu_pytorch_tanh`) and the exact erf form of the patchmergerv2 projector (`gelu`).

use rayon::prelude::*;

use crate::backend::Gelu;

/// `x ← GELU(x)` in place.
pub fn gelu(x: &mut [f32], kind: Gelu) {
    // Large activations (a real tower's MLP is [patches, 4096]) split across the pool.
    const CHUNK: usize = 1 << 14;
    x.par_chunks_mut(CHUNK).for_each(|c| match kind {
        Gelu::Tanh => c.iter_mut().for_each(|v| *v = gelu_tanh(*v)),
        Gelu::Erf => c.iter_mut().for_each(|v| *v = gelu_erf(*v)),
    });
}

/// `0.5 x (1 + tanh(√(2/π) (x + 0.044715 x³)))`.
pub fn gelu_tanh(x: f32) -> f32 {
    const K: f32 = 0.797_884_6; // √(2/π)
    0.5 * x * (1.0 + (K * (x + 0.044_715 * x * x * x)).tanh())
}

/// `0.5 x (1 + erf(x / √2))`.
pub fn gelu_erf(x: f32) -> f32 {
    0.5 * x * (1.0 + libm::erff(x * std::f32::consts::FRAC_1_SQRT_2))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_forms_agree_with_known_values() {
        // GELU(1) = 0.8413447 (erf); the tanh form is 0.8411920.
        assert!((gelu_erf(1.0) - 0.841_344_7).abs() < 1e-6);
        assert!((gelu_tanh(1.0) - 0.841_192).abs() < 1e-6);
        assert_eq!(gelu_erf(0.0), 0.0);
        assert!((gelu_erf(-3.0) + 0.004_049_7).abs() < 1e-6);
    }
}
