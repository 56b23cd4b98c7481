//! SiTU-GLU MLP (spec §2.6): dense layer-0 MLP and the shared experts.

use kimi_kernels::{Backend, SituParams};

use super::config::TextConfig;
use super::error::ModelError;
use super::scratch::{Buf, Scratch};
use super::shard::Shard;
use super::weights::{Part, TensorSource, Weight};

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
    /// Loads the MLP, or rank `sh`'s part of it: a contiguous range of the intermediate rows of
    /// `gate` and `up` and the matching input columns of `down`, whose partial output the caller
    /// all-reduces.
    pub fn load(
        src: &mut dyn TensorSource,
        prefix: &str,
        hidden: usize,
        inter: usize,
        sh: Shard,
    ) -> Result<Mlp, ModelError> {
        let mine = sh.range(inter, 1);
        let (rows, cols) =
            if mine.len() == inter { (Part::Whole, Part::Whole) } else { (Part::Rows(mine.clone()), Part::Cols(mine)) };
        Ok(Mlp {
            gate: src.matrix_part(&format!("{prefix}.gate_proj.weight"), inter, hidden, rows.clone())?,
            up: src.matrix_part(&format!("{prefix}.up_proj.weight"), inter, hidden, rows)?,
            down: src.matrix_part(&format!("{prefix}.down_proj.weight"), hidden, inter, cols)?,
        })
    }

    /// Every weight the MLP keeps.
    pub fn weights(&self) -> Vec<&Weight> {
        vec![&self.gate, &self.up, &self.down]
    }

    /// Every weight the MLP multiplies by.
    pub fn matmul_weights(&mut self) -> Vec<&mut Weight> {
        vec![&mut self.gate, &mut self.up, &mut self.down]
    }

    /// `down(SiTU(gate x, up x))` over this rank's intermediate rows: the whole output at TP 1, a
    /// partial sum to all-reduce otherwise (zero when the rank holds no rows).
    pub fn forward<'s>(&self, be: &dyn Backend, sc: &'s Scratch, x: &[f32], tokens: usize, act: SituParams) -> Buf<'s> {
        if self.gate.rows == 0 {
            return sc.zeroed(tokens * self.down.rows);
        }
        let [g, u] = Weight::matmul_many([&self.gate, &self.up], be, sc, x, tokens);
        self.finish(be, sc, g, &u, tokens, act)
    }

    /// `down(SiTU(g, u))` from this MLP's gate and up projections `g`, `u` (for a caller that
    /// ran them in one op with other projections of the same input).
    pub fn finish<'s>(
        &self,
        be: &dyn Backend,
        sc: &'s Scratch,
        mut g: Buf<'s>,
        u: &[f32],
        tokens: usize,
        act: SituParams,
    ) -> Buf<'s> {
        be.situ_glu(&mut g, u, act);
        self.down.matmul(be, sc, &g, tokens)
    }
}
