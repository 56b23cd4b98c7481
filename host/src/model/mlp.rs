//! SiTU-GLU MLP (spec §2.6): dense layer-0 MLP and the shared experts.

use kimi_kernels::{Backend, SituParams};

use super::config::TextConfig;
use super::error::ModelError;
use super::scratch::{Buf, Scratch};
use super::weights::{TensorSource, Weight};

/// The SiTU activation's constants from the config: gate soft-cap β, optional up-branch cap.
pub fn situ_params(c: &TextConfig) -> SituParams {
    SituParams { beta: c.situ_beta, linear_beta: c.situ_linear_beta }
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

    /// Every weight the MLP multiplies by.
    pub fn matmul_weights(&mut self) -> Vec<&mut Weight> {
        vec![&mut self.gate, &mut self.up, &mut self.down]
    }

    pub fn forward<'s>(&self, be: &dyn Backend, sc: &'s Scratch, x: &[f32], tokens: usize, act: SituParams) -> Buf<'s> {
        let mut g = self.gate.matmul(be, sc, x, tokens);
        let u = self.up.matmul(be, sc, x, tokens);
        be.situ_glu(&mut g, &u, act);
        self.down.matmul(be, sc, &g, tokens)
    }
}
