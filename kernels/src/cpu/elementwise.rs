//! Element-wise ops: the residual add, the sigmoid gate, and the scalar activations other CPU ops
//! share.

pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

pub fn silu(x: f32) -> f32 {
    x * sigmoid(x)
}

/// `acc += x`.
pub fn add(acc: &mut [f32], x: &[f32]) {
    assert_eq!(acc.len(), x.len(), "add: lengths differ");
    acc.iter_mut().zip(x).for_each(|(a, b)| *a += b);
}

/// `gate ← SiLU(gate) · up` (SwiGLU).
pub fn silu_glu(gate: &mut [f32], up: &[f32]) {
    assert_eq!(gate.len(), up.len(), "silu_glu: lengths differ");
    gate.iter_mut().zip(up).for_each(|(g, u)| *g = silu(*g) * u);
}

/// `x *= σ(gate)`.
pub fn sigmoid_mul(x: &mut [f32], gate: &[f32]) {
    assert_eq!(x.len(), gate.len(), "sigmoid_mul: lengths differ");
    x.iter_mut().zip(gate).for_each(|(v, g)| *v *= sigmoid(*g));
}
