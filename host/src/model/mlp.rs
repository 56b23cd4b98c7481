//! SiTU-GLU MLP (spec §2.6): dense layer-0 MLP and the shared experts.

use super::config::TextConfig;
use super::error::ModelError;
use super::weights::{TensorSource, Weight};

/// SiTU activation parameters: gate soft-cap β, optional up-branch soft-cap.
#[derive(Clone, Copy, Debug)]
pub struct Situ {
    pub beta: f32,
    pub linear_beta: Option<f32>,
}

impl Situ {
    pub fn from_config(c: &TextConfig) -> Situ {
        Situ { beta: c.situ_beta, linear_beta: c.situ_linear_beta }
    }

    /// [β·tanh(a/β)·σ(a)] · [β_lin·tanh(u/β_lin)]; σ sees the uncapped gate.
    pub fn apply(&self, a: f32, u: f32) -> f32 {
        kimi_kernels::cpu::situ::situ(a, u, self.beta, self.linear_beta)
    }

    /// In place over `gate` with `up`.
    pub fn apply_rows(&self, gate: &mut [f32], up: &[f32]) {
        kimi_kernels::cpu::situ::situ_rows(gate, up, self.beta, self.linear_beta)
    }
}

/// y = down(SiTU(gate x, up x)).
pub struct Mlp {
    pub gate: Weight,
    pub up: Weight,
    pub down: Weight,
}

impl Mlp {
    pub fn load(src: &mut dyn TensorSource, prefix: &str, hidden: usize, inter: usize) -> Result<Mlp, ModelError> {
        Ok(Mlp {
            gate: src.matrix(&format!("{prefix}.gate_proj.weight"), inter, hidden)?,
            up: src.matrix(&format!("{prefix}.up_proj.weight"), inter, hidden)?,
            down: src.matrix(&format!("{prefix}.down_proj.weight"), hidden, inter)?,
        })
    }

    pub fn forward(&self, x: &[f32], tokens: usize, situ: Situ) -> Vec<f32> {
        let mut g = self.gate.matmul(x, tokens);
        let u = self.up.matmul(x, tokens);
        situ.apply_rows(&mut g, &u);
        self.down.matmul(&g, tokens)
    }
}
